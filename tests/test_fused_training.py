"""``--fused triton`` in training: the fused AdamW and the fused head and loss train
as the unfused run does (on CPU the kernels run in Triton's interpreter), and the
flag says in one sentence where it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scaletrain.commands.cli import main
from scaletrain.config import Config
from scaletrain.kernels import unavailable
from scaletrain.commands.train import launch

pytest.importorskip("triton", reason="the fused kernels need Triton (pip install -e '.[dev]')")


def _losses(cfg: Config, fused: str) -> list[float]:
    out = Path(f"{cfg.run.out}-{fused}")
    launch(cfg.replace(fused=fused, out=str(out)))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows] + [rows[-1]["val_loss"]]


@pytest.mark.parametrize("changes,rel", [
    ({}, 1e-6),                                                # fused head+loss, fused AdamW
    pytest.param({"nproc": 2, "pp": 2}, 1e-6, marks=pytest.mark.slow),  # the kernel on the last stage's logits
    ({"precision": "bf16", "param_dtype": "bf16"}, 1e-4),      # AdamW writes the bf16 working copies
    ({"name": "llama-tiny"}, 1e-6),                            # the untied head of the Llama family
], ids=["plain", "pp2", "bf16-masters", "llama"])
def test_fused_kernels_train_as_the_unfused_run(tiny_cfg, changes, rel):
    cfg = tiny_cfg.replace(steps=3, eval_batches=2, **changes)
    fused, plain = _losses(cfg, "triton"), _losses(cfg, "none")
    assert fused == pytest.approx(plain, rel=rel)
    assert plain[0] != plain[2]


def test_without_a_gpu_or_the_interpreter_the_flag_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "need a CUDA GPU" in unavailable(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert unavailable(torch.device("cpu")) is None


def test_fused_needs_adamw(tiny_cfg, capsys):
    code = main(["train", "--fused", "triton", "--optimizer", "adafactor", "--out", tiny_cfg.run.out])
    err = capsys.readouterr().err
    assert code == 2 and "--fused triton fuses AdamW" in err and len(err.strip().splitlines()) == 1
