"""Pictures of a pipeline step: what every rank computes, and when.

A timeline is one row per rank of the pp group, time flowing right; each
computation (a `schedules.Span`) is a block as long as it lasts, named by
its kind and micro-batch: F forward, B backward (the full backward "BW" is
drawn as B too), W weight gradients (zero-bubble schedules only). Gaps are
the rank idling, waiting for a neighbour.

The *planned* timeline is `simulate(build(...))`: equal costs, a chunk's
forward is one unit. The *measured* one is what a training run recorded in
``RUN_DIR/pipeline.json`` (seconds from the step's start, one list per pp
rank). Both get the same bubble, `schedules.bubble`: the idle share of each
rank's step, ``1 - busy / (last end - first start)``, the step running from
the first computation on any rank to the last, averaged over ranks.

`draw_text` draws in the terminal, `draw_png` a Gantt chart with matplotlib;
`load` gathers what ``scaletrain schedule`` shows and `Timeline.report`
writes it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.parallel.pipeline.schedules import (
    COMPUTE,
    PIPEDREAM_2BW,
    Action,
    Schedule,
    Span,
    bubble,
    bubble_formula,
    build,
    extent,
    idle_shares,
    live_activations,
    simulate,
)

# Fits the default interleaved picture (N=4, M=8, V=2: 57 units) at two characters a unit.
DEFAULT_WIDTH = 125
# ANSI backgrounds; the bright variants mark a rank's odd chunks, like the lower case letters.
_ANSI = {"F": ("44;97", "104;30"), "B": ("42;30", "102;30"), "W": ("43;30", "103;30")}
_PNG_COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
_FORMULAS = {"gpipe": "(N-1)/(M+N-1)", "1f1b": "(N-1)/(M+N-1)", "interleaved": "(N-1)/(VM+N-1)",
             "zb-h1": "(N-1)/(3M+N-1)", PIPEDREAM_2BW: "(N-1)/(3M+N-1)"}
_NO_RECORD = "train with --pp 2 or more to record one."


def formula_text(name: str) -> str:
    """The papers' bubble for schedule ``name``, equal F, B and W costs."""
    return _FORMULAS[name]


def _kind(action: Action) -> str:
    return "B" if action.kind == "BW" else action.kind


@dataclass(frozen=True)
class Pale:
    """Which blocks are drawn pale (lower case, lighter colours): a rank's odd
    chunks, or with ``micro_batches`` (PipeDream-2BW) the odd weight versions."""

    ranks: int
    micro_batches: int | None = None

    def __call__(self, action: Action) -> int:
        return (action.micro // self.micro_batches if self.micro_batches else action.stage // self.ranks) % 2

    @property
    def meaning(self) -> str:
        return "odd weight versions" if self.micro_batches else "odd chunks"

    @classmethod
    def of(cls, schedule: Schedule) -> "Pale":
        return cls(schedule.ranks, schedule.micro_batches if schedule.name == PIPEDREAM_2BW else None)


def _label(action: Action, pale: Pale) -> str:
    letter = _kind(action)
    return f"{letter.lower() if pale(action) else letter}{action.micro}"


def legend(schedule: Schedule) -> str:
    backward = "B input gradient, W weight gradients" if schedule.split_backward \
        else "B backward (input and weight gradients)"
    chunks = "; lower case: the rank's odd chunks (stage = chunk x N + rank)" if schedule.virtual_stages > 1 else ""
    if schedule.name == PIPEDREAM_2BW:
        m = schedule.micro_batches
        chunks = (f"; micro-batches numbered across steps: this step forwards {m}-{2 * m - 1} on weight version 1 "
                  f"(lower case: the odd versions) while each rank's first backwards finish version 0's on its "
                  f"stashed weights")
    return f"F forward, {backward}, each followed by its micro-batch where there is room{chunks}; '.' idle"


def _cells_per_unit(spans: list[list[Span]], columns: int, pale: Pale) -> tuple[float, bool]:
    """Characters per time unit: enough for the shortest block to show its label
    and a space, at most what fits in ``columns``; and whether every block has
    room for its label. A whole number of characters for the shortest block when
    it gets one or more, so that equal computations are equally wide and planned
    timelines (whole units) come out exact."""
    flat = [s for rank in spans for s in rank]
    total = extent(spans)[1]
    shortest = min((s.end - s.start for s in flat if s.end > s.start), default=total)
    label = max(len(_label(s.action, pale)) for s in flat)
    cells = min(label + 1, columns * shortest / total)
    return (math.floor(cells) if cells >= 1 else cells) / shortest, cells >= label


def _paint(cells: list[str], kinds: list[str | None]) -> str:
    """Colour runs of cells of one kind (the key includes the chunk's parity)."""
    out, start = [], 0
    for i in range(1, len(cells) + 1):
        if i == len(cells) or kinds[i] != kinds[start]:
            text = "".join(cells[start:i])
            out.append(text if kinds[start] is None else f"\x1b[{kinds[start]}m{text}\x1b[0m")
            start = i
    return "".join(out)


def draw_text(spans: list[list[Span]], *, colour: bool = False, width: int | None = None,
              unit: str = "unit", title: str = "timeline", pale: Pale | None = None) -> str:
    """A line ``title, 1 unit = k characters:``, then one row per rank, ``width``
    characters at most (blocks narrower than one character still take one).
    When the labels do not fit, every block is its letter repeated: a number
    on some blocks only would read as noise. ``pale``: by default, the odd chunks."""
    ranks = len(spans)
    pale = pale or Pale(ranks)
    frame = f"rank {ranks - 1} |"
    scale, labelled = _cells_per_unit(spans, (width or DEFAULT_WIDTH) - len(frame) - 1, pale)
    t0, total = extent(spans)
    length = round(total * scale)
    per = f"1 {unit} = {scale:.3g} characters" if scale >= 1 else f"1 character = {1 / scale:.3g} {unit}"
    lines = [f"{title}, {per}:"]
    for r, rank in enumerate(spans):
        cells, kinds = ["."] * length, [None] * length
        for s in rank:
            a = min(round((s.start - t0) * scale), length - 1)
            b = max(round((s.end - t0) * scale), a + 1)
            label = _label(s.action, pale)
            cells[a:b] = label.ljust(b - a)[: b - a] if labelled else label[0] * (b - a)
            kinds[a:b] = [_ANSI[_kind(s.action)][pale(s.action)]] * (b - a)
        row = _paint(cells, kinds) if colour else "".join(cells)
        lines.append(f"rank {r:>{len(str(ranks - 1))}} |{row}|")
    return "\n".join(lines)


def _shade(kind: str, pale: int) -> tuple[float, ...]:
    """The kind's colour, paler on pale blocks (as the terminal drawing's lower case)."""
    from matplotlib.colors import to_rgb

    mix = 0.45 if pale else 0.0
    return tuple(c + (1 - c) * mix for c in to_rgb(_PNG_COLOURS[kind]))


def _gantt(axes, spans: list[list[Span]], inches: float, pale: Pale) -> None:
    ranks = len(spans)
    t0, total = extent(spans)
    for r, rank in enumerate(spans):
        axes.broken_barh([(s.start - t0, s.end - s.start) for s in rank], (r - 0.4, 0.8),
                         facecolors=[_shade(_kind(s.action), pale(s.action)) for s in rank],
                         edgecolor="white", linewidth=0.5)
        for s in rank:  # the micro-batch number, where it fits (a digit is ~0.6 font sizes wide)
            if (s.end - s.start) / total * inches * 72 >= len(str(s.action.micro)) * 7 * 0.6 + 2:
                axes.text((s.start + s.end) / 2 - t0, r, str(s.action.micro), ha="center", va="center",
                          fontsize=7, color="black" if pale(s.action) else "white")
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top
    axes.set_xlim(0, total)


def draw_png(path: Path, panels: list[tuple[str, list[list[Span]], str]], pale: Pale | None = None) -> None:
    """A Gantt chart per (title, spans, x label), stacked, written as a PNG; ``pale``
    as in `draw_text`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = max(len(spans) for _, spans, _ in panels)
    inches = 11.0
    figure, axes = plt.subplots(len(panels), 1, squeeze=False,
                                figsize=(inches, len(panels) * (0.4 * ranks + 1.4)))
    for ax, (title, spans, xlabel) in zip(axes[:, 0], panels):
        shading = pale or Pale(len(spans))
        _gantt(ax, spans, inches * 0.85, shading)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        shown = {(_kind(s.action), shading(s.action)) for rank in spans for s in rank}
        ax.legend(handles=[Patch(color=_shade(k, odd), label=f"{k}, {shading.meaning}" if odd else k)
                           for odd in (0, 1) for k in "FBW" if (k, odd) in shown],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=120)
    plt.close(figure)


def read_measured(run_dir: Path) -> tuple[dict, list[list[Span]]]:
    """``RUN_DIR/pipeline.json``: its sizes (schedule, pp, microbatches,
    virtual_stages, step) and each pp rank's spans, in seconds."""
    path = run_dir / "pipeline.json"
    if not path.is_file():
        raise UserError(f"--measured {run_dir} holds no pipeline timeline (pipeline.json); {_NO_RECORD}")
    try:
        record = json.loads(path.read_text())
        sizes = {"schedule": str(record["schedule"]), "step": record.get("step")}
        sizes |= {key: int(record[key]) for key in ("pp", "microbatches", "virtual_stages")}
        spans = [[Span(Action(str(e["kind"]), int(e["micro"]), int(e["stage"])), float(e["start"]),
                       float(e["end"])) for e in rank] for rank in record["ranks"]]
        if len(spans) != sizes["pp"] or not all(spans):
            raise ValueError(f"it needs a non-empty list of spans for each of its pp {sizes['pp']} ranks")
        if any(s.action.kind not in COMPUTE for rank in spans for s in rank):
            raise ValueError(f"a kind is not one of {', '.join(COMPUTE)}")
        if any(s.end < s.start for rank in spans for s in rank) or extent(spans)[1] <= 0:
            raise ValueError("a span ends before it starts, or the step takes no time")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise UserError(f"--measured {run_dir}: {path.name} is not a readable pipeline timeline ({reason}); "
                        f"{_NO_RECORD}") from exc
    return sizes, spans


def _resolve(flags: dict[str, str | int | None], recorded: dict | None, where: Path | None) -> dict:
    """The sizes to draw: the run's when one is given (flags that disagree are an
    error, not silently ignored), else the flags with the CLI's defaults."""
    if recorded is not None:
        for key, value in flags.items():
            if value is not None and value != recorded[key]:
                flag = {"schedule": "pp-schedule", "virtual_stages": "virtual-stages"}.get(key, key)
                raise UserError(f"--{flag} {value} disagrees with {key} {recorded[key]} recorded in "
                                f"{where}; leave --{flag} out or give {recorded[key]}.")
        return {key: recorded[key] for key in flags}
    name = flags["schedule"] or "1f1b"
    defaults = {"schedule": name, "pp": 4, "microbatches": 8,
                "virtual_stages": 2 if name == "interleaved" else 1}
    return {key: defaults[key] if value is None else value for key, value in flags.items()}


def _scaled(spans: list[list[Span]], factor: float) -> list[list[Span]]:
    return [[Span(s.action, s.start * factor, s.end * factor) for s in rank] for rank in spans]


@dataclass(frozen=True)
class Timeline:
    """A schedule's planned timeline and, from a training run, the measured one (seconds)."""

    schedule: Schedule
    planned: list[list[Span]]
    measured: list[list[Span]] | None = None
    step: int | None = None

    @property
    def heading(self) -> str:
        s = self.schedule
        return f"{s.name}, N={s.ranks}, M={s.micro_batches}, V={s.virtual_stages}"

    def to_json(self) -> dict:
        s = self.schedule
        out = {"schedule": s.name, "pp": s.ranks, "microbatches": s.micro_batches,
               "virtual_stages": s.virtual_stages, "bubble_planned": bubble(self.planned),
               "bubble_formula": bubble_formula(s.name, s.ranks, s.micro_batches, s.virtual_stages),
               "live_activations": [live_activations(s.compute(r)) for r in range(s.ranks)]}
        if self.measured is not None:
            out |= {"bubble_measured": bubble(self.measured),
                    "bubble_measured_per_rank": idle_shares(self.measured)}
        return out

    def panels(self) -> list[tuple[str, list[list[Span]], str]]:
        """The PNG's panels: planned above, measured (in ms) below."""
        out = [(f"{self.heading}: planned, bubble {bubble(self.planned):.4f}", self.planned,
                "time (units of one forward)")]
        if self.measured is not None:
            out.append((f"{self.heading}: measured at step {self.step}, bubble {bubble(self.measured):.4f}",
                        _scaled(self.measured, 1e3), "time (ms)"))
        return out

    def report(self, *, colour: bool = False, width: int | None = None) -> str:
        """The drawings, the legend, the bubble line and the peak activations."""
        summary = self.to_json()
        chunk = "chunk " if self.schedule.virtual_stages > 1 else ""
        pale = Pale.of(self.schedule)
        parts = [draw_text(self.planned, colour=colour, width=width, unit=f"{chunk}forward",
                           title=f"{self.heading}, planned", pale=pale)]
        if self.measured is not None:
            parts.append(draw_text(_scaled(self.measured, 1e3), colour=colour, width=width, unit="ms",
                                   title=f"measured at step {self.step}", pale=pale))
        line = (f"bubble: planned {summary['bubble_planned']:.4f} (formula {formula_text(self.schedule.name)} "
                f"= {summary['bubble_formula']:.4f})")
        if self.measured is not None:
            per_rank = ", ".join(f"{x:.4f}" for x in summary["bubble_measured_per_rank"])
            line += f", measured {summary['bubble_measured']:.4f} (per rank: {per_rank})"
        live = f"peak live {chunk}activations per rank: {', '.join(map(str, summary['live_activations']))}"
        return "\n".join([*parts, legend(self.schedule), line, live])


def load(name: str | None, pp: int | None, microbatches: int | None, virtual_stages: int | None,
         measured: Path | None = None) -> Timeline:
    """What ``scaletrain schedule`` shows: flags left out are None (the
    defaults, or the run's sizes when ``measured`` names a run folder)."""
    recorded, spans = read_measured(measured) if measured is not None else (None, None)
    flags = {"schedule": name, "pp": pp, "microbatches": microbatches, "virtual_stages": virtual_stages}
    sizes = _resolve(flags, recorded, None if measured is None else measured / "pipeline.json")
    try:
        schedule = build(sizes["schedule"], sizes["pp"], sizes["microbatches"], sizes["virtual_stages"])
    except ValueError as exc:  # the sizes a schedule refuses, already in the user's words
        raise UserError(f"{str(exc).rstrip('.')}.") from exc
    return Timeline(schedule, simulate(schedule), spans, None if recorded is None else recorded["step"])
