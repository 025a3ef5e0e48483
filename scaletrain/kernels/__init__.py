"""Triton kernels, each beside the pure-PyTorch reference it is tested against.

A Triton kernel runs on a CUDA GPU, or, slowly, in Triton's interpreter on
the CPU when the environment has ``TRITON_INTERPRET=1`` before Triton is
imported (the tests do this when no GPU is present). `unavailable` says, in
one sentence, why the kernels cannot run here, or None when they can.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def interpreted() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable(device: torch.device, flag: str = "--fused triton") -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can (``flag``: the
    option that asked for them, named in the way out)."""
    if importlib.util.find_spec("triton") is None:
        return f"Triton is not installed; pip install triton (on a CUDA machine), or drop {flag}."
    if device.type != "cuda" and not interpreted():
        return (f"Triton kernels need a CUDA GPU, and this run is on {device.type}; run on a GPU, or set "
                f"TRITON_INTERPRET=1 to run them in Triton's interpreter (slowly), or drop {flag}.")
    return None
