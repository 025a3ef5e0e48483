"""Every technique on the Llama family, proven against one device.

Each row is ``scaletrain parity`` on llama-tiny (RMSNorm, rotary positions,
grouped-query attention with 4 query and 2 key/value heads, SwiGLU, an untied
head): the layout and the single-device reference train with the same seed,
data and global batch, and losses, gradient norms and final weights agree
within relative 1e-5 in fp32 (the whole-model rule of scaletrain/commands/parity.py).
Every row clips (``--grad-clip 0.5`` is below the tiny model's gradient norm),
so a norm that counted a split, replicated or sharded gradient twice, or
missed one, changes every update.

bf16 rows compare a bf16 layout with the bf16 reference: the reduction order
differs between layouts and bf16 keeps 8 bits of mantissa, so their rule is
relative 1e-2 (the fp32 rows are the exact proof; the bf16 rows show the
precision machinery composes with the family).
"""

from __future__ import annotations

import pytest

from scaletrain.commands.cli import main
from scaletrain.commands.parity import run_parity
from scaletrain.errors import UserError

CLIP = 0.5
LLAMA = dict(name="llama-tiny", grad_clip=CLIP, steps=3)
MOE = dict(moe_experts=4, moe_top_k=2)

LAYOUTS = {
    "dp2": dict(nproc=2, dp=2),
    "zero1-dp2": dict(nproc=2, dp=2, zero=1),
    "zero2-dp2-accum": dict(nproc=2, dp=2, zero=2, grad_accum=2),
    "zero3-dp2": dict(nproc=2, dp=2, zero=3),
    "hybrid-zero3-dp4": dict(nproc=4, dp=4, zero=3, shard_group=2, micro_batch=2),
    "tp2": dict(nproc=2, tp=2),
    "tp2-sp": dict(nproc=2, tp=2, sp=True),
    "pp2-gpipe": dict(nproc=2, pp=2, pp_schedule="gpipe"),
    "pp2-1f1b": dict(nproc=2, pp=2, pp_schedule="1f1b"),
    "pp2-interleaved": dict(nproc=2, pp=2, pp_schedule="interleaved", n_layers=4),
    "pp2-zb-h1": dict(nproc=2, pp=2, pp_schedule="zb-h1"),
    "pp2-pipedream-2bw": dict(nproc=2, pp=2, pp_schedule="pipedream-2bw"),
    "cp2": dict(nproc=2, cp=2),
    "cp2-tp2-sp": dict(nproc=4, cp=2, tp=2, sp=True),
    "ep2-moe": dict(nproc=2, ep=2, **MOE),
    "dp2-pp2-tp2": dict(nproc=8, dp=2, pp=2, tp=2, micro_batch=2),
    "dp2-pp2-tp2-sp-zero1": dict(nproc=8, dp=2, pp=2, tp=2, sp=True, zero=1, micro_batch=2),
    "recompute-full-tp2": dict(nproc=2, tp=2, recompute="full"),
    "recompute-selective-dp2": dict(nproc=2, dp=2, recompute="selective"),
    "compile-dp2": dict(nproc=2, dp=2, compile=True),
    "qkv-bias-tp2-sp": dict(nproc=2, tp=2, sp=True, bias=True),
    "mqa-dp2": dict(nproc=2, dp=2, n_kv_heads=1),
    "tied-pp2": dict(nproc=2, pp=2, tie_embeddings=True),
}
# Representative rows in the default run; `pytest -m slow` runs them all.
# (The README's `scaletrain parity --model llama-tiny --nproc 4 --dp 2 --tp 2 --sp` adds dp x tp.)
# (ZeRO-3 and the pipelines run by default elsewhere: tests/test_llama_hf.py, tests/test_sft_parity.py,
# tests/test_pipeline.py, tests/test_nd.py.)
IN_CI = {"tp2-sp", "cp2", "ep2-moe", "qkv-bias-tp2-sp"}  # pp2 1F1B: tests/test_sft_parity.py


@pytest.mark.numerics
@pytest.mark.parametrize("changes", [pytest.param(changes, id=name, marks=() if name in IN_CI else pytest.mark.slow)
                                     for name, changes in LAYOUTS.items()])
def test_llama_layout_reproduces_single_device_training(tiny_cfg, changes):
    report = run_parity(tiny_cfg.replace(**{**LLAMA, **changes}), tolerance=1e-5)
    assert report.passed, report.to_json()
    # clipping was active (PipeDream-2BW's first step applies no gradient, so it has no norm)
    assert all(norm > CLIP for norm in report.reference_grad_norms if norm is not None)
    assert report.reference_losses[0] != report.reference_losses[-1]


@pytest.mark.parametrize("changes", [
    dict(nproc=2, dp=2, precision="bf16", param_dtype="bf16"),
    pytest.param(dict(nproc=2, tp=2, sp=True, precision="bf16"), marks=pytest.mark.slow),
], ids=["dp2-bf16-masters", "tp2-sp-bf16"])
def test_llama_in_bf16_follows_the_bf16_reference(tiny_cfg, changes):
    report = run_parity(tiny_cfg.replace(**{**LLAMA, **changes}), tolerance=1e-2)
    assert report.passed, report.to_json()


def test_parity_by_command(tiny_cfg, capsys):
    args = ["parity", "--model", "llama-tiny", "--nproc", "2", "--tp", "2", "--sp", "--steps", "2",
            "--seq-len", "32", "--micro-batch", "4", "--data", tiny_cfg.data.data, "--cache-dir",
            tiny_cfg.data.cache_dir, "--json"]
    assert main(args) == 0
    assert '"pass": true' in capsys.readouterr().out


def test_tensor_parallelism_must_divide_the_key_value_heads(tiny_cfg, capsys):
    code = main(["train", "--model", "llama-tiny", "--nproc", "4", "--tp", "4", "--out", tiny_cfg.run.out])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "2 key/value heads" in err and "--tp" in err


def test_the_key_value_heads_must_divide_the_query_heads(tiny_cfg):
    with pytest.raises(UserError, match="--n-kv-heads"):
        run_parity(tiny_cfg.replace(**LLAMA, n_kv_heads=3), tolerance=1e-5)
