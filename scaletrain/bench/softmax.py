"""``scaletrain bench softmax`` and ``bench cross-entropy``: the fused kernels against torch's.

Each contender runs forward and backward on the same inputs, alternating
call by call in rotating order, a CUDA synchronize before and after each
call; the figure is the median over the timed calls (``--steps``, after
``--warmup``). Inputs are fp32, or bf16 with ``--precision bf16``.

softmax: rows of a 124M-parameter decoder's attention scores (micro-batch 8 x 12 heads x
1024 queries, 1024 keys: one block a row) and rows as long as its vocabulary
(50304: the two-pass online path), ours (kernels/softmax.py) against
F.softmax. Bandwidth is the least traffic the work needs over the time:
forward reads x and writes y, backward reads y and dy and writes dx, 5MN
elements, the same count for both, so it says how near each comes to the
memory's speed.

cross-entropy: the same decoder's output head and loss, 8192 tokens (micro-batch
8 x 1024) of d_model 768 over 50304 words: our fused head + loss in chunks
(kernels/cross_entropy.py) against the trainer's way, the logits
materialised by a matmul, ``.float()`` and F.cross_entropy, and, on a GPU,
the same compiled by torch.compile. Peak memory is the most allocated
during a forward and backward beyond what was allocated before it (inputs
and weights): what each way adds. A second table times the loss alone on
given logits, our kernel against F.cross_entropy, with the bandwidth of the
least traffic, reading the logits and writing their gradient (2NV).

Without a GPU the kernels run only in Triton's interpreter
(``TRITON_INTERPRET=1``): the benchmarks then run tiny shapes, to check
that they work and agree; their times measure the interpreter.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from scaletrain.bench import machine, median
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.kernels import interpreted
from scaletrain.techniques.precision import compute_dtype

# (rows, cols, what they are); tiny ones for the interpreter, the second spanning blocks
SOFTMAX_SHAPES = [(8 * 12 * 1024, 1024, "124M attention rows"), (8192, 50304, "50k vocabulary rows")]
SOFTMAX_SHAPES_INTERPRETED = [(8, 48, "tiny rows"), (4, 9000, "rows of two blocks")]
# (tokens, d_model, vocabulary)
CE_SHAPE = (8 * 1024, 768, 50304)
CE_SHAPE_INTERPRETED = (16, 8, 100)

Step = Callable[[], torch.Tensor]


def run_softmax(cfg: Config, warmup: int) -> dict:
    """Time our softmax against F.softmax, forward and backward; the result as ``bench --json`` prints it."""
    from scaletrain.kernels.softmax import softmax

    device, dtype = _setup(cfg, warmup)
    shapes = [_softmax_shape(softmax, rows, cols, label, cfg.train.steps, warmup, device, dtype)
              for rows, cols, label in (SOFTMAX_SHAPES_INTERPRETED if interpreted() else SOFTMAX_SHAPES)]
    first = shapes[0]
    return {**_header("softmax", cfg, warmup, device, dtype),
            "ours": {"name": "fused softmax (kernels/softmax.py)", "median_s": first["ours_s"],
                     "gbps": first["ours_gbps"]},
            "peer": {"name": "F.softmax", "median_s": first["peer_s"], "gbps": first["peer_gbps"]},
            "ratio": first["ratio"], "max_abs_diff": max(s["max_abs_diff"] for s in shapes), "shapes": shapes}


def _softmax_shape(softmax: Callable[[torch.Tensor], torch.Tensor], rows: int, cols: int, label: str, calls: int,
                   warmup: int, device: torch.device, dtype: torch.dtype) -> dict:
    """One shape's row of the softmax table: both contenders' times, bandwidths and difference."""
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(rows, cols, device=device, generator=generator).to(dtype).requires_grad_()
    dy = torch.randn(rows, cols, device=device, generator=generator).to(dtype)
    steps = {"ours": _forward_backward(lambda: softmax(x), dy, [x]),
             "peer": _forward_backward(lambda: F.softmax(x, dim=-1), dy, [x])}
    times = _race(steps, calls, warmup, device)
    traffic = 5 * rows * cols * dtype.itemsize
    return {"label": label, "rows": rows, "cols": cols, "bytes": traffic,
            **{f"{name}_s": t for name, t in times.items()},
            **{f"{name}_gbps": traffic / t / 1e9 for name, t in times.items()},
            "ratio": times["ours"] / times["peer"], "max_abs_diff": _largest_gap(steps, [x])}


def run_cross_entropy(cfg: Config, warmup: int) -> dict:
    """Time our fused head + loss against materialised logits and F.cross_entropy; as ``bench --json`` prints it."""
    device, dtype = _setup(cfg, warmup)
    tokens, d_model, vocab = CE_SHAPE_INTERPRETED if interpreted() else CE_SHAPE
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(tokens, d_model, device=device, generator=generator).to(dtype).requires_grad_()
    weight = (0.02 * torch.randn(vocab, d_model, device=device, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    head, head_gap = _race_heads(hidden, weight, targets, cfg.train.steps, warmup)
    logits = (hidden @ weight.T).detach().requires_grad_()
    loss, loss_gap = _race_losses(logits, targets, cfg.train.steps, warmup)
    return {**_header("cross-entropy", cfg, warmup, device, dtype),
            "tokens": tokens, "d_model": d_model, "vocab": vocab,
            "ours": head["ours"], "peer": head["peer"], "compiled": head.get("compiled"),
            "ratio": head["ours"]["median_s"] / head["peer"]["median_s"],
            "max_abs_diff": max(head_gap, loss_gap), "logits": loss}


def _race_heads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, calls: int,
                warmup: int) -> tuple[dict, float]:
    """Head + loss, ours against the trainer's way (and its torch.compile on a GPU):
    each one's time and peak memory, and the largest difference between ours and the peer."""
    from scaletrain.kernels.cross_entropy import fused_linear_cross_entropy
    from scaletrain.kernels.head_loss import chunk_rows

    def materialised() -> torch.Tensor:
        return F.cross_entropy((hidden @ weight.T).float(), targets)

    chunk = chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0])
    losses = {"ours": (f"fused head + loss in chunks of {chunk} rows",
                       lambda: fused_linear_cross_entropy(hidden, weight, targets)),
              "peer": ("logits, .float(), F.cross_entropy", materialised)}
    if hidden.is_cuda:  # on CPU, torch.compile would time Inductor's C++, not the GPU kernels raced here
        losses["compiled"] = ("the same, torch.compile'd", torch.compile(materialised))
    leaves = [hidden, weight]
    steps = {key: _forward_backward(loss, None, leaves) for key, (_, loss) in losses.items()}
    times = _race(steps, calls, warmup, hidden.device)
    result = {key: {"name": name, "median_s": times[key], "peak_bytes": _peak_bytes(steps[key], leaves)}
              for key, (name, _) in losses.items()}
    gap = _largest_gap(steps, leaves)
    _drop_grads(leaves)
    return result, gap


def _race_losses(logits: torch.Tensor, targets: torch.Tensor, calls: int, warmup: int) -> tuple[dict, float]:
    """The loss alone on given logits, our kernel against F.cross_entropy: times,
    bandwidths, and the largest difference between them."""
    from scaletrain.kernels.cross_entropy import cross_entropy

    steps = {"ours": _forward_backward(lambda: cross_entropy(logits, targets), None, [logits]),
             "peer": _forward_backward(lambda: F.cross_entropy(logits.float(), targets), None, [logits])}
    times = _race(steps, calls, warmup, logits.device)
    traffic = 2 * logits.numel() * logits.element_size()
    names = {"ours": "fused cross-entropy (kernels/cross_entropy.py)", "peer": "F.cross_entropy(logits.float())"}
    result = {"bytes": traffic, "ratio": times["ours"] / times["peer"],
              **{key: {"name": name, "median_s": times[key], "gbps": traffic / times[key] / 1e9}
                 for key, name in names.items()}}
    return result, _largest_gap(steps, [logits])


def _setup(cfg: Config, warmup: int) -> tuple[torch.device, torch.dtype]:
    """The device the kernels can run on and the inputs' dtype, or a UserError saying why not."""
    if importlib.util.find_spec("triton") is None:
        raise UserError("bench softmax and cross-entropy time Triton kernels; pip install triton on a CUDA machine.")
    if not torch.cuda.is_available() and not interpreted():
        raise UserError("bench softmax and cross-entropy time Triton kernels and need a CUDA GPU (or "
                        "TRITON_INTERPRET=1 for a slow functional run on tiny shapes).")
    if warmup >= cfg.train.steps:
        raise UserError(f"--warmup {warmup} leaves no timed call of --steps {cfg.train.steps}; "
                        f"raise --steps or lower --warmup.")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu"), compute_dtype(cfg.train.precision)


def _header(what: str, cfg: Config, warmup: int, device: torch.device, dtype: torch.dtype) -> dict:
    return {"what": what, "machine": machine(), "device": device.type, "dtype": str(dtype).removeprefix("torch."),
            "interpreted": interpreted(), "steps": cfg.train.steps, "timed_steps": cfg.train.steps - warmup}


def _forward_backward(forward: Step, grad: torch.Tensor | None, leaves: list[torch.Tensor]) -> Step:
    """A call of ``forward`` and its backward (from ``grad``, or 1 for a scalar)
    into fresh gradients of ``leaves``; returns the output."""
    def step() -> torch.Tensor:
        _drop_grads(leaves)
        out = forward()
        out.backward(grad)
        return out.detach()
    return step


def _drop_grads(leaves: list[torch.Tensor]) -> None:
    for leaf in leaves:
        leaf.grad = None


def _gives(step: Step, leaves: list[torch.Tensor]) -> torch.Tensor:
    """The output of a call of ``step`` and the gradients it leaves, flat, in fp32: what contenders must agree on."""
    out = step()
    return torch.cat([out.float().flatten(), *(leaf.grad.float().flatten() for leaf in leaves)])


def _largest_gap(steps: dict[str, Step], leaves: list[torch.Tensor]) -> float:
    """The largest difference between what ours and the peer give."""
    return (_gives(steps["ours"], leaves) - _gives(steps["peer"], leaves)).abs().max().item()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _race(steps: dict[str, Step], calls: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Each step's median time over ``calls`` calls after the first ``warmup``, called in rotating order."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for call in range(calls):
        first = call % len(names)
        for name in names[first:] + names[:first]:
            _synchronize(device)
            start = time.perf_counter()
            steps[name]()
            _synchronize(device)
            if call >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: median(t) for name, t in times.items()}


def _peak_bytes(step: Step, leaves: list[torch.Tensor]) -> int | None:
    """The most a call of ``step`` allocated on the GPU beyond the inputs (None on CPU)."""
    device = leaves[0].device
    if device.type != "cuda":
        return None
    _drop_grads(leaves)  # else the last call's gradients count as input, and are freed inside the peak
    _synchronize(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    _synchronize(device)
    return torch.cuda.max_memory_allocated() - before


def format_table(result: dict) -> str:
    """``bench softmax`` or ``bench cross-entropy``'s result as a table."""
    title = (f"bench {result['what']}: {result['dtype']} on {result['device']}, {result['steps']} calls "
             f"({result['timed_steps']} timed), on {result['machine']}")
    lines = [title]
    if result["interpreted"]:
        lines.append("interpreted (TRITON_INTERPRET=1): tiny shapes, and the times measure Triton's interpreter")
    if result["what"] == "softmax":
        lines += _softmax_rows(result)
    else:
        lines += _cross_entropy_rows(result)
    lines.append(f"largest difference from torch (outputs and gradients): {result['max_abs_diff']:.1e}")
    return "\n".join(lines)


def _softmax_rows(result: dict) -> list[str]:
    lines = [f"{'':<32}{'ours ms':>10}{'ours GB/s':>11}{'torch ms':>10}{'torch GB/s':>12}{'ours/torch':>12}"]
    for s in result["shapes"]:
        shape = f"{s['label']} {s['rows']}x{s['cols']}"
        lines.append(f"{shape:<32}{1e3 * s['ours_s']:>10.3f}"
                     f"{s['ours_gbps']:>11.1f}{1e3 * s['peer_s']:>10.3f}{s['peer_gbps']:>12.1f}{s['ratio']:>12.3f}")
    lines.append("forward + backward; GB/s: the least traffic (read x, write y, read y and dy, write dx) over the time")
    return lines


def _cross_entropy_rows(result: dict) -> list[str]:
    lines = [(f"head + loss: {result['tokens']} tokens x d_model {result['d_model']} -> vocabulary "
              f"{result['vocab']}, forward + backward"),
             f"{'':<52}{'ms':>10}{'peak MiB':>10}"]
    for key in ("ours", "peer", "compiled"):
        if result[key] is not None:
            c = result[key]
            peak = "n/a" if c["peak_bytes"] is None else f"{c['peak_bytes'] / 2**20:.0f}"
            lines.append(f"{c['name']:<52}{1e3 * c['median_s']:>10.3f}{peak:>10}")
    lines.append(f"ours / logits + F.cross_entropy: {result['ratio']:.3f}")
    loss = result["logits"]
    lines.append(f"loss alone on given logits: {'':<25}{'ms':>10}{'GB/s':>10}")
    for key in ("ours", "peer"):
        c = loss[key]
        lines.append(f"{c['name']:<52}{1e3 * c['median_s']:>10.3f}{c['gbps']:>10.1f}")
    lines.append(f"ours / F.cross_entropy: {loss['ratio']:.3f}; GB/s: reading the logits and writing their gradient "
                 f"(2NV elements) over the time; peak: beyond the inputs")
    return lines
