"""Pipeline schedules as data: for every rank, the ordered list of what it does.

The model's layers are cut into ``S = N * V`` stages over the ``N`` ranks of the pp group;
rank ``r`` holds the ``V`` chunks ``stage = chunk * N + r`` (Megatron's interleaved
placement; ``V = 1`` is one stage per rank). A step pushes ``M`` micro-batches through
all stages. A schedule is a pure function of ``(N, M, V)`` returning one list of
`Action`s per rank, computations (`COMPUTE`) and transfers (`TRANSFERS`): the runtime
(runtime.py) executes these lists, the drawing (timeline.py) draws them, `simulate` times
them; one source for all three. The schedules (t_f, t_b, t_w: the costs of F, B and W
per stage; the bubble is the idle share of each rank's step):

GPipe (Huang et al. 2019)
    every forward, then every backward. Bubble ``(N-1)/(M+N-1)``; every rank holds the
    activations of all M micro-batches at the turn.
1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training")
    ``N-r-1`` warm-up forwards on rank r, then a forward and a backward in turn, then the
    drain. Same bubble as GPipe, but at most ``N - r`` micro-batches held: memory bounded
    by N, not M.
Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters")
    micro-batches in groups of N (M divisible by N) through chunk 0, then chunk 1, ...;
    ``2(N-r-1) + (V-1)N`` warm-up chunk forwards. Fill and drain V times shorter: bubble
    ``(N-1)/(VM+N-1)`` (Megatron's ``(1/V)(N-1)/M`` of the ideal time), for V times more
    point-to-point transfers and ``1 + (N-1)/(NV)`` times 1F1B's activations on rank 0
    (at most ``2(N-r-1) + (V-1)N + 1`` chunk activations on rank r).
ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism")
    backward split into B (input gradient, on the critical path: the upstream rank waits
    for it) and W (weight gradients, needed only by the optimizer); 1F1B's order, rank r
    postponing its first ``r`` W's, so the gradient travels upstream at the pace of B and
    the W's fill the drain. Bubble ``(N-1)(t_f+t_b-t_w)`` against 1F1B's
    ``(N-1)(t_f+t_b+t_w)``: a third of it for equal costs, ``(N-1)/(3M+N-1)`` (reached
    for M >= N). Activations live from F to W, at most N per rank, as in 1F1B.

Communication, one rule for every schedule: a receive right before the computation that
needs it, a send right after the one that produced it, neighbouring transfers one batch.
The runtime waits for a batch's receives only, so a rank never idles because a neighbour
has not asked for its output yet (waiting for sends too costs ZB-H1 its advantage);
`simulate` has these semantics and fails if ranks could wait on each other in a cycle.
Per pair of ranks, receives are posted in the order of the sends, as backends that match
messages in order (NCCL) need. One exception, PipeDream-2BW's: the gradient a rank's
first backward of a step needs comes from the next rank's last backward of the step
before, and is received at the end of that step, so that no message is in flight across
the step's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The schedules that flush the pipeline every step (the planner models these), and the one that does not.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
PIPEDREAM_2BW = "pipedream-2bw"
ALL_SCHEDULES = (*SCHEDULES, PIPEDREAM_2BW)
# F forward; BW input and weight gradients; B input gradient only; W weight gradients, where a rank would idle
COMPUTE = ("F", "BW", "B", "W")
# act: a stage's output, to the next stage's rank; grad: its input's gradient, to the previous stage's rank
TRANSFERS = ("send_act", "recv_act", "send_grad", "recv_grad")
# Cost of each computation on one chunk, in units of a chunk's forward: equal F, B and W costs.
UNIT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}


@dataclass(frozen=True)
class Action:
    """One entry of a rank's list. ``stage`` is the global stage index; for a
    transfer, ``peer`` is the other rank's index in the pp group, and
    (micro, stage) name the tensor: the output (act) or the input gradient
    (grad) of that stage, sent, or received by the neighbouring stage."""

    kind: str
    micro: int
    stage: int
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def __str__(self) -> str:
        text = f"{self.kind}{self.micro}@s{self.stage}"
        return text if self.peer is None else f"{text}->{self.peer}" if self.kind.startswith("send") \
            else f"{text}<-{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """A schedule's per-rank action lists, communication included."""

    name: str
    ranks: int
    micro_batches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        """Whether weight gradients are separate W actions (zero bubble)."""
        return any(a.kind == "W" for a in self.actions[0])

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def chunk_of(self, stage: int) -> int:
        return stage // self.ranks

    def stages_of(self, rank: int) -> list[int]:
        return [chunk * self.ranks + rank for chunk in range(self.virtual_stages)]

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def steps(self, rank: int) -> list[Action | tuple[Action, ...]]:
        """The rank's list as the runtime walks it: computations, and
        neighbouring transfers grouped into one batch (a tuple)."""
        out: list[Action | tuple[Action, ...]] = []
        batch: list[Action] = []
        for action in self.actions[rank]:
            if action.is_compute:
                if batch:
                    out.append(tuple(batch))
                    batch = []
                out.append(action)
            else:
                batch.append(action)
        if batch:
            out.append(tuple(batch))
        return out


# -- the compute orders --------------------------------------------------------
def _gpipe(n: int, m: int, r: int) -> list[Action]:
    return [Action("F", i, r) for i in range(m)] + [Action("BW", i, r) for i in range(m)]


def _one_f_one_b(n: int, m: int, r: int) -> list[Action]:
    warmup = min(n - r - 1, m)
    order = [Action("F", i, r) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [Action("F", warmup + i, r), Action("BW", i, r)]
    return order + [Action("BW", i, r) for i in range(m - warmup, m)]


def _interleaved(n: int, m: int, v: int, r: int) -> list[Action]:
    """Megatron's order: the k-th chunk forward of a rank is micro-batch
    ``(k // (N V)) N + k mod N`` on chunk ``(k // N) mod V``; backwards run the
    chunks in reverse."""
    total = m * v

    def micro(k: int) -> int:
        return (k // (n * v)) * n + k % n

    def forward(k: int) -> Action:
        return Action("F", micro(k), (k // n) % v * n + r)

    def backward(k: int) -> Action:
        return Action("BW", micro(k), (v - 1 - (k // n) % v) * n + r)

    warmup = min(2 * (n - r - 1) + (v - 1) * n, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]


def _zb_h1(n: int, m: int, r: int) -> list[Action]:
    """1F1B with B and W apart: W of micro-batch i runs after B of i + r, so
    rank r holds at most ``(N - r - 1) + 1 + r = N`` micro-batches between F and W."""
    order: list[Action] = []
    pending_w: list[int] = []

    def backward(i: int) -> None:
        order.append(Action("B", i, r))
        pending_w.append(i)
        if len(pending_w) > r:
            order.append(Action("W", pending_w.pop(0), r))

    warmup = min(n - r - 1, m)
    order += [Action("F", i, r) for i in range(warmup)]
    for i in range(m - warmup):
        order.append(Action("F", warmup + i, r))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return order + [Action("W", i, r) for i in pending_w]


def _two_bw(n: int, m: int, r: int, step: int) -> list[Action]:
    """PipeDream-2BW's step ``step`` on rank r: the forwards of that version's
    micro-batches (numbered across steps), each followed by the backward of
    the micro-batch ``N-r-1`` earlier (none before micro-batch 0: the first
    step is 1F1B's warm-up)."""
    lag = n - r - 1
    order = []
    for i in range(step * m, (step + 1) * m):
        order.append(Action("F", i, r))
        if i >= lag:
            order.append(Action("BW", i - lag, r))
    return order


def compute_orders(name: str, n: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each rank's computations, in order, for schedule ``name`` (PipeDream-2BW: its steady state)."""
    check(name, n, m, v)
    builders: dict[str, Callable[[int], list[Action]]] = {
        "gpipe": lambda r: _gpipe(n, m, r),
        "1f1b": lambda r: _one_f_one_b(n, m, r),
        "interleaved": lambda r: _interleaved(n, m, v, r),
        "zb-h1": lambda r: _zb_h1(n, m, r),
        PIPEDREAM_2BW: lambda r: _two_bw(n, m, r, 1),
    }
    return [builders[name](r) for r in range(n)]


def check(name: str, n: int, m: int, v: int) -> None:
    """The (N, M, V) a schedule accepts; ValueError in the user's words otherwise."""
    if name not in ALL_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(ALL_SCHEDULES)}")
    if n < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline sizes must be at least 1, got pp {n}, microbatches {m}, "
                         f"virtual stages {v}")
    if v > 1 and name != "interleaved":
        raise ValueError(f"--virtual-stages {v} needs --pp-schedule interleaved, not {name}")
    if name == "interleaved" and v < 2:
        raise ValueError("the interleaved schedule with one chunk per rank is 1f1b; give --virtual-stages "
                         "2 or more, or use --pp-schedule 1f1b")
    if name == "interleaved" and m % n:
        raise ValueError(f"the interleaved schedule sends micro-batches in groups of --pp {n}; "
                         f"choose --microbatches divisible by {n}, not {m}")
    if name == PIPEDREAM_2BW and m < n:
        raise ValueError(f"pipedream-2bw makes a weight version every --microbatches micro-batches and keeps "
                         f"two; with fewer than --pp {n} a third would still be in flight: choose --microbatches "
                         f"{n} or more, not {m}")


# -- communication ---------------------------------------------------------------
def _with_transfers(orders: list[list[Action]], n: int, stages: int) -> tuple[tuple[Action, ...], ...]:
    """Insert each transfer next to the computation it serves."""
    out = []
    for r, order in enumerate(orders):
        actions: list[Action] = []
        for a in order:
            if a.kind == "F" and a.stage > 0:
                actions.append(Action("recv_act", a.micro, a.stage - 1, (a.stage - 1) % n))
            if a.kind in ("BW", "B") and a.stage < stages - 1:
                actions.append(Action("recv_grad", a.micro, a.stage + 1, (a.stage + 1) % n))
            actions.append(a)
            if a.kind == "F" and a.stage < stages - 1:
                actions.append(Action("send_act", a.micro, a.stage, (a.stage + 1) % n))
            if a.kind in ("BW", "B") and a.stage > 0:
                actions.append(Action("send_grad", a.micro, a.stage, (a.stage - 1) % n))
        out.append(tuple(actions))
    return tuple(out)


def build(name: str, n: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` for N ranks, M micro-batches and V chunks per rank
    (PipeDream-2BW: one step of its steady state, `two_bw_step` 1)."""
    if name == PIPEDREAM_2BW:
        check(name, n, m, v)
        return two_bw_step(n, m, 1)
    orders = compute_orders(name, n, m, v)
    return Schedule(name, n, m, v, _with_transfers(orders, n, n * v))


def two_bw_step(n: int, m: int, step: int) -> Schedule:
    """PipeDream-2BW's step ``step`` (0: the warm-up), transfers placed by the
    rule, except the gradient that the next step's first backward needs when
    this step produces it: received at this step's end (the module docstring)."""

    def produced_in(recv: Action) -> int:  # the step of the backward that sends this gradient
        return (recv.micro + n - recv.stage - 1) // m

    this, following = (_with_transfers([_two_bw(n, m, r, s) for r in range(n)], n, n) for s in (step, step + 1))
    actions = tuple(
        tuple(a for a in mine if a.kind != "recv_grad" or produced_in(a) == step)
        + tuple(a for a in ahead if a.kind == "recv_grad" and produced_in(a) == step)
        for mine, ahead in zip(this, following))
    return Schedule(PIPEDREAM_2BW, n, m, 1, actions)


def forward_only(n: int, m: int, v: int = 1) -> Schedule:
    """Evaluation and generation: each micro-batch through every stage, no backward."""
    orders = [[Action("F", i, c * n + r) for i in range(m) for c in range(v)] for r in range(n)]
    return Schedule("forward", n, m, v, _with_transfers(orders, n, n * v))


# -- properties, for the tests, the drawing and the planner ---------------------
def live_activations(order: list[Action]) -> int:
    """The most chunk-activations a rank holds at once: a micro-batch's from
    its F until its backward is complete (BW, or W when backward is split);
    a backward without its F in ``order`` (PipeDream-2BW) finishes a
    micro-batch held since the step before."""
    forwarded = {(a.micro, a.stage) for a in order if a.kind == "F"}
    live = peak = sum(a.kind in ("BW", "W") and (a.micro, a.stage) not in forwarded for a in order)
    for a in order:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind in ("BW", "W"):
            live -= 1
    return peak


def bubble_formula(name: str, n: int, m: int, v: int = 1, costs: dict[str, float] = UNIT_COSTS) -> float:
    """The idle share of a step the papers give, for uniform stages."""
    f, b, w = costs["F"], costs["B"], costs["W"]
    busy = m * v * (f + b + w)
    # Per rank: 1F1B's fill and drain; ZB-H1 fills the drain with W's; 2BW has no drain, only the fill.
    idle = (n - 1) * {"zb-h1": f + b - w, PIPEDREAM_2BW: f}.get(name, f + b + w)
    return idle / (busy + idle)


@dataclass(frozen=True)
class Span:
    """A computation placed in time."""

    action: Action
    start: float
    end: float


class Deadlock(RuntimeError):
    pass


def _matching(a: Action) -> Action:
    """The transfer on the peer that completes ``a`` (its own rank is the peer's peer)."""
    partner = {"send_act": "recv_act", "recv_act": "send_act", "send_grad": "recv_grad",
               "recv_grad": "send_grad"}[a.kind]
    return Action(partner, a.micro, a.stage, None)


def simulate(schedule: Schedule, costs: dict[str, float] = UNIT_COSTS) -> list[list[Span]]:
    """Time every rank's computations, transfers taking no time.

    The runtime's semantics: a batch posts its sends and goes on (they
    complete in the background); it waits for its receives, each of which
    completes once the peer has posted the matching send (after the
    computation that produced the tensor). A computation starts when its
    rank is free. Raises `Deadlock` if ranks wait on each other in a cycle.
    """
    steps = [schedule.steps(r) for r in range(schedule.ranks)]
    position = [0] * schedule.ranks
    clock = [0.0] * schedule.ranks
    sent: dict[tuple[int, Action], float] = {}  # (rank, send without peer) -> time posted
    spans: list[list[Span]] = [[] for _ in range(schedule.ranks)]
    progress = True
    while progress:
        progress = False
        for r in range(schedule.ranks):
            while position[r] < len(steps[r]):
                step = steps[r][position[r]]
                if isinstance(step, Action):
                    end = clock[r] + costs[step.kind]
                    spans[r].append(Span(step, clock[r], end))
                    clock[r] = end
                else:
                    for a in step:
                        if a.kind.startswith("send"):
                            sent.setdefault((r, Action(a.kind, a.micro, a.stage)), clock[r])
                    arrivals = [sent.get((a.peer, _matching(a))) for a in step if a.kind.startswith("recv")]
                    if None in arrivals:
                        break
                    clock[r] = max([clock[r], *arrivals])
                position[r] += 1
                progress = True
    stuck = [r for r in range(schedule.ranks) if position[r] < len(steps[r])]
    if stuck:
        waits = "; ".join(f"rank {r} at {', '.join(map(str, steps[r][position[r]]))}" for r in stuck)
        raise Deadlock(f"schedule {schedule.name} deadlocks: {waits}")
    return spans


def extent(spans: list[list[Span]]) -> tuple[float, float]:
    """The step's first start and its length, over all ranks."""
    start = min(s.start for rank in spans for s in rank)
    return start, max(s.end for rank in spans for s in rank) - start


def idle_shares(spans: list[list[Span]]) -> list[float]:
    """Each rank's idle share of the step: 1 - busy / (last end - first start), over all ranks."""
    total = extent(spans)[1]
    return [1 - sum(s.end - s.start for s in rank) / total for rank in spans]


def bubble(spans: list[list[Span]]) -> float:
    """The idle share of the step, averaged over ranks."""
    shares = idle_shares(spans)
    return sum(shares) / len(shares)
