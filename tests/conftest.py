"""Shared fixtures: a small text corpus and short-run configurations."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter; it must be chosen before
# Triton is first imported, which some test may do at any point.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's on-disk cache does not key its C++ kernels by ATEN_CPU_CAPABILITY: a kernel generated
# with AVX2 or AVX-512 by one run fails to build ("'at::vec' has not been declared") in a later run
# under ATEN_CPU_CAPABILITY=default, which CI runs after the suite. One cache per capability.
_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "native")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path(tempfile.gettempdir(), f"torchinductor-{os.getuid()}-{_CAPABILITY}")))

# A machine profile of this machine (scaletrain plan --calibrate, planner/profile.py) changes what the
# gate, --micro-batch auto and --layout auto plan with: the tests plan without one unless they write
# their own, whatever the machine's user has calibrated.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="scaletrain-tests-cache-")
os.environ.pop("SCALETRAIN_PROFILE", None)

from scaletrain.config import Config


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~40 KB of varied text: enough windows for short runs, fast to tokenize."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    lines = [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(800)]
    path.write_text("".join(lines))
    return path


@pytest.fixture
def tiny_cfg(corpus, tmp_path) -> Config:
    """gpt-tiny for a few steps: a fraction of a second per step."""
    return Config().replace(name="gpt-tiny", data=str(corpus), seq_len=32, micro_batch=4, steps=4,
                            warmup_steps=1, eval_every=0, eval_batches=1, sample_tokens=0,
                            progress=False, out=str(tmp_path / "run"),
                            cache_dir=str(tmp_path / "cache"))


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``scaletrain ARGS`` in a fresh interpreter, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)
