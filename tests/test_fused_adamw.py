"""The fused multi-tensor AdamW: kernel, reference and torch.optim.AdamW agree; launches; state."""

from __future__ import annotations

import os

import torch

# triton.jit picks the interpreter when it decorates, so this precedes every import of Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy
import json

import pytest

pytest.importorskip("triton", reason="the fused AdamW kernel is written in Triton")

from scaletrain.bench import adam as bench_adam
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.kernels import adamw as kernel
from scaletrain.optim.fused_adamw import TritonAdamW
from scaletrain.train import checkpoint as ckpt

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# 1-D and 2-D, sizes off the block, one over two blocks (BLOCK is 2048), one element.
SHAPES = [(37,), (5, 7), (kernel.BLOCK * 2 + 3,), (33, 65), (1,), (3, 4, 5)]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def _params(shapes=SHAPES, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(DEVICE, dtype) for shape in shapes]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _set_grads(params: list[torch.Tensor], step: int, skip: int | None = None) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=gen).to(DEVICE, p.dtype)
        p.grad = None if i == skip else grad


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    """Steps like the trainer's: a new lr each step; parameter 1 has no gradient on step 2."""
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (1 + step) / 5
        _set_grads(params, step, skip=1 if step == 2 else None)
        opt.step()


@pytest.mark.numerics
def test_kernel_reference_and_torch_adamw_agree_over_steps():
    """Element by element, within a bound that holds on any CPU: the gradients are N(0, 1), far
    above Adam's eps, so each update lr * m / (sqrt(v) + eps) is computed to a few fp32 ulps
    (relative 1e-6) by any order of its operations; five steps of lr <= 2e-2 then differ by at most
    5 * 2e-2 * 1e-6 = 1e-7 absolute, ten times inside the tolerance. A wrong formula (bias
    correction, decay, a step count) is off by 1e-3 or more in the first step."""
    runs = {}
    for name in ("kernel", "reference", "torch"):
        params = _params()
        opt = (torch.optim.AdamW(_groups(params), foreach=True, **HYPER) if name == "torch"
               else TritonAdamW(_groups(params), reference=name == "reference", **HYPER))
        _run(opt, params, range(5))
        runs[name] = (params, opt)
    want_params, want_opt = runs["torch"]
    for name in ("kernel", "reference"):
        params, opt = runs[name]
        for p, q in zip(params, want_params):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[p][key], want_opt.state[q][key], rtol=1e-6, atol=1e-7)
            assert torch.equal(opt.state[p]["step"], want_opt.state[q]["step"])
    # The parameter without a gradient on one step was stepped four times, the others five.
    kernel_params, kernel_opt = runs["kernel"]
    assert [kernel_opt.state[p]["step"].item() for p in kernel_params] == [5, 4, 5, 5, 5, 5]


def test_bf16_working_copies_are_the_rounded_fp32_params():
    params = _params()
    working = [p.to(torch.bfloat16) for p in params]
    opt = TritonAdamW(_groups(params), **HYPER)
    opt.attach_working_copies(zip(params, working))
    _run(opt, params, range(3))
    params[0].grad[3] = float("nan")  # a NaN must round to NaN, not wrap to zero
    opt.step()
    for p, w in zip(params, working):
        torch.testing.assert_close(w, p.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    assert working[0][3].isnan() and not working[0][2].isnan()


def test_bf16_params_and_moments_match_the_reference_within_rounding():
    runs = []
    for reference in (False, True):
        params = _params(dtype=torch.bfloat16)
        opt = TritonAdamW(_groups(params), reference=reference, **HYPER)
        _run(opt, params, range(3))
        runs.append((params, opt))
    # Both compute in fp32 and round once; the last bit may differ where fp32 results straddle a tie.
    for p, q in zip(runs[0][0], runs[1][0]):
        torch.testing.assert_close(p, q, rtol=2**-7, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(runs[0][1].state[p][key], runs[1][1].state[q][key],
                                       rtol=2**-7, atol=1e-6)


def test_a_loaded_state_dict_continues_identically_from_torch_or_ours():
    params = _params()
    opt = TritonAdamW(_groups(params), **HYPER)
    torch_params = _params()
    torch_opt = torch.optim.AdamW(_groups(torch_params), foreach=True, **HYPER)
    for o, ps in ((opt, params), (torch_opt, torch_params)):
        _run(o, ps, range(3))
    for saved_opt, saved_params in ((opt, params), (torch_opt, torch_params)):
        fresh = [p.detach().clone() for p in saved_params]
        resumed = TritonAdamW(_groups(fresh), **HYPER)
        resumed.load_state_dict(copy.deepcopy(saved_opt.state_dict()))
        _run(resumed, fresh, range(3, 5))
        _run(saved_opt, saved_params, range(3, 5))
        for p, q in zip(fresh, saved_params):
            if saved_opt is opt:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        # Ours continues exactly from its own state; the state stays torch's kind.
        assert set(resumed.state[fresh[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_materializing_state_for_a_checkpoint_leaves_the_params_alone():
    params = _params()
    before = [p.clone() for p in params]
    opt = TritonAdamW(_groups(params), **HYPER)
    ckpt.materialize_optimizer_state(opt)
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(params, before))
    assert all(opt.state[p]["step"].item() == 1 for p in params)


def test_one_launch_per_group_and_tables_built_once(monkeypatch):
    launches, rebuilds = [], []
    real_launch, real_rebuild = kernel._launch, kernel.AdamWLaunch._rebuild
    monkeypatch.setattr(kernel, "_launch", lambda grid, *a, **k: (launches.append(grid), real_launch(grid, *a, **k)))
    monkeypatch.setattr(kernel.AdamWLaunch, "_rebuild",
                        lambda self, *a: (rebuilds.append(1), real_rebuild(self, *a)))
    params = _params([(3, 5)] * 10 + [(7,)] * 10)
    _set_grads(params, 0)
    opt = TritonAdamW(_groups(params), **HYPER)
    counts = []
    for _ in range(3):  # the same gradient tensors each step
        opt.step()
        counts.append((len(launches), len(rebuilds)))
        launches.clear(), rebuilds.clear()
    assert counts == [(2, 2), (2, 0), (2, 0)]  # one launch per group; tables kept
    params[0].grad = params[0].grad.clone()  # a new buffer: only its group's pointer table is rebuilt
    opt.step()
    assert (len(launches), len(rebuilds)) == (2, 1)


def test_unfit_tensors_are_refused():
    params = _params([(4, 6)])
    opt = TritonAdamW(params, **HYPER)
    params[0].grad = torch.ones(6, 4, device=DEVICE).t()  # the right shape, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    with pytest.raises(ValueError, match="does not step"):
        opt.attach_working_copies([(torch.zeros(3), torch.zeros(3))])


def test_bench_adam_interpreted_race_reports_consistent_figures(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the interpreted race is the no-GPU path")
    result = bench_adam.run(Config().replace(steps=3), warmup=1)
    json.dumps(result)
    assert result["what"] == "adam" and result["interpreted"] and "meaningless" in result["note"]
    assert result["peer"]["name"] == bench_adam.FUSED
    assert [peer["name"] for peer in result["peers"]] == [bench_adam.FOREACH, bench_adam.FUSED]
    largest = max(result["sets"], key=lambda row: row["params"])
    assert result["ours"]["median_s"] == largest[bench_adam.OURS]["median_s"] > 0
    assert result["ratio"] == pytest.approx(result["ours"]["median_s"] / result["peer"]["median_s"])
    assert result["ours"]["gbps"] == pytest.approx(28 * largest["params"] / result["ours"]["median_s"] / 1e9)
    assert result["ours"]["peak_fraction"] is None and result["peak_bandwidth_gbps"] is None
    assert "meaningless" in bench_adam.format_table(result)
    monkeypatch.setattr(bench_adam, "interpreted", lambda: False)
    with pytest.raises(UserError, match="run it on a CUDA GPU, or with TRITON_INTERPRET=1"):
        bench_adam.run(Config(), warmup=1)


def test_gpu_parameter_sets_have_the_intended_sizes():
    sizes = {name: sum(torch.Size(s).numel() for s in bench_adam.parameter_shapes(cfg))
             for name, cfg in bench_adam.GPU_SETS.items()}
    assert 123e6 < sizes["124m"] < 126e6 and 0.9e9 < sizes["1b"] < 1.1e9
