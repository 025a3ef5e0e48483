"""Pipeline schedules as pure data, checked without any process."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from scaletrain.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Deadlock,
    Schedule,
    bubble,
    bubble_formula,
    build,
    live_activations,
    simulate,
)


def _cases():
    for name in SCHEDULES:
        for n, m in itertools.product((2, 3, 4), (1, 2, 3, 4, 8)):
            for v in ((2, 3) if name == "interleaved" else (1,)):
                if name == "interleaved" and m % n:
                    continue
                yield name, n, m, v


CASES = list(_cases())


@pytest.mark.parametrize("name,n,m,v", CASES)
def test_every_micro_batch_forwarded_and_backwarded_once_on_every_stage(name, n, m, v):
    schedule = build(name, n, m, v)
    done = Counter()
    for rank in range(n):
        for a in schedule.compute(rank):
            assert schedule.rank_of(a.stage) == rank, f"{a} runs on rank {rank}"
            done[a.kind, a.micro, a.stage] += 1
    backward = ("B", "W") if name == "zb-h1" else ("BW",)
    expected = {(kind, i, s): 1 for kind in ("F", *backward) for i in range(m) for s in range(n * v)}
    assert dict(done) == expected


@pytest.mark.parametrize("name,n,m,v", CASES)
def test_dependencies_respected_in_simulated_time(name, n, m, v):
    """F of a micro-batch after its F on the stage before; its backward after its
    own F and after the backward on the stage after; W after B."""
    spans = simulate(build(name, n, m, v))
    at = {(s.action.kind, s.action.micro, s.action.stage): s for rank in spans for s in rank}
    last = n * v - 1
    for (kind, micro, stage), span in at.items():
        needs = []
        if kind == "F" and stage > 0:
            needs.append(("F", micro, stage - 1))
        if kind in ("B", "BW"):
            needs.append(("F", micro, stage))
            if stage < last:
                needs.append((kind, micro, stage + 1))
        if kind == "W":
            needs.append(("B", micro, stage))
        for need in needs:
            assert at[need].end <= span.start, f"{kind}{micro}@s{stage} starts before {need} ends"


def assert_receives_match_sends(schedule, n: int) -> None:
    """Per ordered pair of ranks, what one sends is what the other expects, in order."""
    for a, b in itertools.permutations(range(n), 2):
        sends = [(x.kind[5:], x.micro, x.stage) for x in schedule.actions[a]
                 if x.kind.startswith("send") and x.peer == b]
        recvs = [(x.kind[5:], x.micro, x.stage) for x in schedule.actions[b]
                 if x.kind.startswith("recv") and x.peer == a]
        assert sends == recvs


@pytest.mark.parametrize("name,n,m,v", CASES)
def test_receives_posted_in_the_order_of_the_sends(name, n, m, v):
    """Per ordered pair of ranks, what one sends is what the other expects, in order."""
    assert_receives_match_sends(build(name, n, m, v), n)


def test_live_activations_as_each_schedule_promises():
    for n, m in itertools.product((2, 3, 4), (1, 4, 8, 12)):
        gpipe, one_f_one_b, zb = (build(name, n, m) for name in ("gpipe", "1f1b", "zb-h1"))
        for r in range(n):
            assert live_activations(gpipe.compute(r)) == m
            assert live_activations(one_f_one_b.compute(r)) == min(n - r, m)
            assert live_activations(zb.compute(r)) <= n
        assert max(live_activations(zb.compute(r)) for r in range(n)) == min(n, m)
        if m % n == 0:
            for v in (2, 3):
                interleaved = build("interleaved", n, m, v)
                for r in range(n):  # chunk activations: Megatron's warm-up plus the one in flight
                    bound = min(2 * (n - r - 1) + (v - 1) * n + 1, m * v)
                    assert live_activations(interleaved.compute(r)) == bound


def test_memory_of_1f1b_is_bounded_by_ranks_not_micro_batches():
    """The case the memory ledger measures: M = 8, N = 2."""
    assert live_activations(build("gpipe", 2, 8).compute(0)) == 8
    assert live_activations(build("1f1b", 2, 8).compute(0)) == 2


# ZB-H1 reaches its formula once there are at least N micro-batches to fill the drain with W's.
@pytest.mark.parametrize("name,n,m,v", [c for c in CASES if not (c[0] == "zb-h1" and c[2] < c[1])])
def test_simulated_bubble_equals_the_formula(name, n, m, v):
    assert bubble(simulate(build(name, n, m, v))) == pytest.approx(bubble_formula(name, n, m, v), abs=1e-12)


def test_bubble_formulas_by_hand():
    assert bubble_formula("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_formula("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_formula("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_formula("zb-h1", 4, 8) == pytest.approx(3 / 27)
    # ZB-H1's idle time is a third of 1F1B's with equal F, B and W costs.
    busy = 8 * 3
    idle = {name: busy * f / (1 - f) for name, f in (("1f1b", bubble_formula("1f1b", 4, 8)),
                                                    ("zb-h1", bubble_formula("zb-h1", 4, 8)))}
    assert idle["zb-h1"] == pytest.approx(idle["1f1b"] / 3)


def test_zero_bubble_splits_backward_and_delays_weight_gradients_on_later_ranks():
    schedule = build("zb-h1", 4, 8)
    assert schedule.split_backward and not build("1f1b", 4, 8).split_backward
    for r in range(4):  # W of micro-batch 0 comes after B of micro-batch r
        kinds = [(a.kind, a.micro) for a in schedule.compute(r)]
        assert kinds.index(("W", 0)) > kinds.index(("B", r))


def test_transfers_batch_between_computations():
    schedule = build("1f1b", 2, 4)
    steps = schedule.steps(0)
    batches = [s for s in steps if isinstance(s, tuple)]
    # In the steady state a rank sends an activation and receives a gradient in one batch.
    assert (Action("send_act", 1, 0, 1), Action("recv_grad", 0, 1, 1)) in batches


def test_a_cycle_of_waits_is_reported():
    broken = Schedule("broken", 2, 1, 1, (
        (Action("recv_grad", 0, 1, 1), Action("F", 0, 0), Action("send_act", 0, 0, 1), Action("BW", 0, 0)),
        (Action("recv_act", 0, 0, 0), Action("F", 0, 1), Action("BW", 0, 1), Action("send_grad", 0, 1, 0)),
    ))
    with pytest.raises(Deadlock, match="rank 0 at recv_grad0@s1<-1"):
        simulate(broken)


@pytest.mark.parametrize("args,message", [
    (("zigzag", 2, 4, 1), "unknown pipeline schedule"),
    (("1f1b", 2, 4, 2), "needs --pp-schedule interleaved"),
    (("interleaved", 2, 4, 1), "is 1f1b"),
    (("interleaved", 4, 6, 2), "divisible by 4"),
])
def test_bad_sizes_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        build(*args)
