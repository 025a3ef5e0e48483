"""``scaletrain bench throughput``: our trainer's step against a plain loop and transformers'.

Three contenders train the same model (family, size and initial weights) on the same batches
with the same optimizer settings and learning-rate schedule, each in a process of its own, so
that compilation, the allocator and CUDA's peak memory are each one's alone:

    scaletrain     the command's trainer (job/trainer.py) with every default of the run
    plain          a plain PyTorch loop over our own model: its SDPA attention, autocast at
                   --precision, torch.compile of the whole model with --compile, and
                   torch.optim.AdamW (fused, as ours), clipped by torch's clip_grad_norm_: our
                   overhead's floor
    transformers   transformers' own model of the family (the ``AutoModelForCausalLM`` class of
                   the config our adapter writes) with its SDPA attention and our initial weights,
                   in the same loop: what a Hugging Face user gets (left out, with the reason,
                   where transformers does not import)

Every step ends with its loss read, so each step's wall time is its own. Reported per
contender: the median step time after ``--warmup`` (compilation, allocator warm-up), over
every round's timed steps with ``--rounds R`` (the contenders run R times, in an order
rotated each round, so that a noisy machine's slow spells fall on all of them; each round's
ratio is printed beside the pooled one),

    tokens/s = micro-batch x grad-accum x seq_len / median step time
    MFU      = tokens/s x F / peak,   F = 6 N + 12 L d_attn s   (per token; models/spec.py)

with one F for all three, the model's own (N: the weights of its matrix products, the head
included; the attention's score and value products as the second term), the peak the
device's dense rate at --precision (``--peak-tflops`` sets another; none on a CPU unless
set), the peak memory (CUDA's allocator, or the process's resident set on a CPU), and the
losses: the same weights and batches make the same losses, the proof of equal work (where the
peer's format has biases ours lacks, they start at zero and then train). ``ratio`` is ours over the
peer's median step time (the peer: transformers, else the plain loop); below 1 we are faster.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.bench import machine, median, rotated
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.job.data_setup import PreparedData, open_data, prepare_data
from scaletrain.job.export_hf import hf_tensors
from scaletrain.job.metrics import mfu, peak_tflops
from scaletrain.job.trainer import Trainer, build_run_model, first_sample
from scaletrain.models import CLASSIFIER, spec_for
from scaletrain.optim import decay_groups, run_lr
from scaletrain.runtime.comm import Comm
from scaletrain.runtime.launch import detect_environment, init_distributed, shutdown
from scaletrain.runtime.mesh import Mesh, ParallelDims
from scaletrain.techniques.precision import autocast
from scaletrain.train.memory import peak_resident_bytes

CONTENDERS = ("scaletrain", "plain", "transformers")
OURS, PLAIN, HF = CONTENDERS


def check(cfg: Config, warmup: int, rounds: int = 1, peers: tuple[str, ...] = (PLAIN, HF)) -> None:
    """What bench throughput cannot measure, in one sentence, before any process starts."""
    if rounds < 1:
        raise UserError(f"--rounds must be at least 1, not {rounds}.")
    unknown = [name for name in peers if name not in (PLAIN, HF)]
    if unknown:
        raise UserError(f"--peers names {', '.join(unknown)}; choose among {PLAIN} and {HF} (or none: '').")
    if cfg.parallel.nproc > 1 or detect_environment().world_size > 1:
        raise UserError("bench throughput measures one device's step; drop --nproc and run it in one process.")
    if cfg.model.name == CLASSIFIER:
        raise UserError("bench throughput races language models; give --model a language model's preset.")
    if cfg.data.sft or cfg.data.pack:
        raise UserError("bench throughput races plain text windows, which a plain loop reads as they are; drop "
                        "--sft and --pack.")
    if warmup >= cfg.train.steps:
        raise UserError(f"--warmup {warmup} leaves no timed step of --steps {cfg.train.steps}; "
                        f"raise --steps or lower --warmup.")


def run(cfg: Config, warmup: int, rounds: int = 1, peers: tuple[str, ...] = (PLAIN, HF)) -> dict:
    """Ours and each of ``peers`` in a process of its own, one after another, ``rounds`` times (in an
    order rotated each round); the bench JSON of them all (no peers: ours alone, its MFU)."""
    check(cfg, warmup, rounds, peers)
    cfg = cfg.replace(nproc=1, sample_tokens=0, eval_every=0, progress=False, checkpoint_every=0)
    prepared = prepare_data(cfg, cache_dir=Path(cfg.data.cache_dir))
    racing = [name for name in CONTENDERS if name == OURS or name in peers]
    measured: dict[str, list[dict]] = {name: [] for name in racing}
    for round_ in range(rounds):
        for name in rotated(racing, round_):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
                measured[name].append(process.submit(measure, name, cfg, prepared, warmup).result())
    return report(cfg, warmup, {name: pooled(runs, warmup) for name, runs in measured.items()})


def pooled(runs: list[dict], warmup: int) -> dict:
    """A contender's rounds as one row: its median over every round's timed steps (the machine's
    slow spells fall on every contender alike, round after round), each round's median beside it,
    and the first round's losses and the largest peak."""
    first = runs[0]
    if first.get("skipped"):
        return first
    timed = [seconds for run in runs for seconds in run["step_s"][warmup:]]
    step_s = median(timed)
    return {**first, "median_s": step_s, "round_medians_s": [run["median_s"] for run in runs],
            "tokens_per_s": first["tokens_per_step"] / step_s,
            "mfu": mfu(first["tokens_per_step"] / step_s, first["flops_per_token"], first["peak_tflops"], 1),
            "peak_memory_bytes": max(run["peak_memory_bytes"] for run in runs)}


def report(cfg: Config, warmup: int, rows: dict[str, dict]) -> dict:
    ours = rows[OURS]
    peers = [rows[name] for name in (HF, PLAIN) if name in rows and rows[name].get("skipped") is None]
    peer = peers[0] if peers else None
    for row in peers:
        row["ratio"] = ours["median_s"] / row["median_s"]
        row["round_ratios"] = [a / b for a, b in zip(ours["round_medians_s"], row["round_medians_s"])]
        row["max_loss_rel_diff_to_ours"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], ours["losses"]))
    t = cfg.train
    return {"what": "throughput", "machine": machine(), "ours": ours, "peer": peer, "peers": peers,
            "skipped": {name: row["skipped"] for name, row in rows.items() if row.get("skipped")},
            "ratio": ours["median_s"] / peer["median_s"] if peer else None,
            "setup": {"model": cfg.model.name, "seq_len": cfg.data.seq_len, "micro_batch": t.micro_batch,
                      "grad_accum": t.grad_accum, "precision": t.precision, "compile": t.compile,
                      "compile_mode": t.compile_mode,
                      "steps": t.steps, "warmup": warmup, "timed_steps": t.steps - warmup,
                      "rounds": len(ours["round_medians_s"]),
                      "tokens_per_step": ours["tokens_per_step"], "flops_per_token": ours["flops_per_token"],
                      "peak_tflops": ours["peak_tflops"], "device": ours["device"]}}


# -- one contender, in its own process ---------------------------------------------------------------


def measure(name: str, cfg: Config, prepared: PreparedData, warmup: int) -> dict:
    """``name``'s steps timed: its row of the report (``skipped``: why it could not run)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = cfg.train
    tokens_per_step = t.micro_batch * t.grad_accum * cfg.data.seq_len
    with tempfile.TemporaryDirectory(prefix="scaletrain-throughput-") as run_dir:
        if name == OURS:
            runtime = init_distributed(detect_environment(), timeout_s=cfg.parallel.timeout)
            try:
                one_rank = Mesh.build(ParallelDims.infer(1), 0, 1)
                trainer = Trainer(cfg, prepared, runtime, one_rank, Comm(), Path(run_dir))
                steps = _timed(lambda step: trainer.train_step(step)["loss"], t.steps, device)
                flops = trainer.flops_per_token
            finally:
                shutdown(runtime)
        else:
            built = build_run_model(cfg, prepared, device)
            model, flops = built.model, built.flops_per_token
            if name == HF:
                try:
                    model = transformers_twin(model, cfg)
                except ImportError as missing:
                    return {"name": name, "skipped": f"transformers does not import here ({missing})"}
            steps = _timed(_plain_loop(model, cfg, prepared, device), t.steps, device)
    times, losses = zip(*steps)
    step_s = median(list(times[warmup:]))
    peak = peak_tflops(t.peak_tflops, device, t.precision)
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_resident_bytes()
    return {"name": name, "device": str(device), "step_s": list(times), "losses": list(losses), "median_s": step_s,
            "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / step_s,
            "flops_per_token": flops, "peak_tflops": peak,
            "mfu": mfu(tokens_per_step / step_s, flops, peak, 1), "peak_memory_bytes": memory}


def _timed(step: Callable[[int], float], steps: int, device: torch.device) -> list[tuple[float, float]]:
    """(wall seconds, loss) of each step; the loss read ends the step."""
    timed = []
    for index in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = step(index)
        timed.append((time.perf_counter() - start, loss))
    return timed


def transformers_twin(model: nn.Module, cfg: Config) -> nn.Module:
    """transformers' model of ``model``'s family and size, its SDPA attention, with ``model``'s
    weights (the names its Hugging Face adapter maps), returning logits [batch, seq, vocab]."""
    import transformers

    adapter = spec_for(cfg.model.name).hf
    config = adapter.config_to_hf(model.cfg)
    twin = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), attn_implementation="sdpa").to(next(model.parameters()).device)
    tensors = dict(hf_tensors({k: v.detach() for k, v in model.state_dict().items()}, adapter.names(model.cfg)))
    unexpected = twin.load_state_dict(tensors, strict=False).unexpected_keys
    assert not unexpected, unexpected  # the adapter names only what the class holds
    return _Logits(twin)


class _Logits(nn.Module):
    """A ``*ForCausalLM`` whose forward takes ids and gives the logits, as ours does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def _plain_loop(model: nn.Module, cfg: Config, prepared: PreparedData, device: torch.device) -> Callable[[int], float]:
    """One step of a plain PyTorch loop over ``model``: the run's batches, loss, clipping and
    schedule; torch's fused AdamW; the whole model compiled with --compile."""
    t = cfg.train
    data = open_data(prepared, cfg)
    optimizer = torch.optim.AdamW(decay_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                                  fused=True)
    forward = torch.compile(model) if t.compile else model
    model.train()

    def step(index: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = run_lr(index, t)
        total = torch.zeros((), device=device)
        for micro in range(t.grad_accum):
            x, y = (tensor.to(device) for tensor in
                    data.train.get(first_sample(index, micro, t.grad_accum, 1, 0, t.micro_batch), t.micro_batch)[:2])
            with autocast(t.precision, device):
                logits = forward(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / t.grad_accum
            loss.backward()
            total += loss.detach()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total.item()
    return step


def _mode(setup: dict) -> str:
    """How ours compiled, where not as the plain loop does."""
    mode = setup.get("compile_mode", "default")
    return f" ({mode})" if setup["compile"] and mode != "default" else ""


def format_table(result: dict) -> str:
    setup = result["setup"]
    lines = [f"{setup['model']}, seq {setup['seq_len']}, micro-batch {setup['micro_batch']} x {setup['grad_accum']}, "
             f"{setup['precision']}{', compiled' if setup['compile'] else ''}{_mode(setup)}, on {setup['device']} "
             f"({result['machine']}); median of {setup['timed_steps']} timed steps"
             f"{' x ' + str(setup['rounds']) + ' rounds' if setup.get('rounds', 1) > 1 else ''}, each process its own",
             f"{'contender':<14}{'step s':>10}{'tokens/s':>12}{'MFU':>8}{'peak memory':>14}{'ours/it':>9}"
             f"{'loss diff':>11}"]
    for row in (result["ours"], *result["peers"]):
        share = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else ""
        diff = f"{row['max_loss_rel_diff_to_ours']:.1e}" if "ratio" in row else ""
        lines.append(f"{row['name']:<14}{row['median_s']:>10.4f}{row['tokens_per_s']:>12,.0f}{share:>8}"
                     f"{row['peak_memory_bytes'] / 2**20:>11,.0f} MiB{ratio:>9}{diff:>11}")
    lines.extend(f"{name}: left out, {why}" for name, why in result["skipped"].items())
    if setup.get("rounds", 1) > 1:
        lines.extend(f"ours/{row['name']} round by round: " + ", ".join(f"{r:.3f}" for r in row["round_ratios"])
                     for row in result["peers"])
    lines.append(f"FLOPs per token 6N + 12 L d s = {setup['flops_per_token']:.4g}; MFU against "
                 + (f"{setup['peak_tflops']:g} TFLOP/s" if setup["peak_tflops"] else "no known peak (--peak-tflops)")
                 + (f"; ratio {result['ratio']:.3f} = our median step / {result['peer']['name']}'s"
                    if result["peer"] else "; no peer raced (--peers '')"))
    return "\n".join(lines)
