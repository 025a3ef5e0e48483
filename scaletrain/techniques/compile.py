"""``--compile``: torch.compile applied per transformer block.

torch.compile (Ansel et al. 2024, "PyTorch 2") captures a module's Python
forward as a graph (TorchDynamo), derives the backward graph ahead of time
(AOTAutograd), and generates fused kernels (Inductor: Triton on GPU, C++/OpenMP
on CPU). What it saves is memory traffic: a chain of elementwise operations
(bias-free GELU, residual add, dropout, the norm's scale and shift) becomes
one kernel that reads its input once and writes its output once, instead of
one round trip through memory per operation. Matrix products still go to
the vendor library, so the gain is largest where elementwise work and kernel
launches dominate: small models, small batches, long chains of cheap ops.

Why per block rather than the whole model: the L blocks run the same code on
same-shaped tensors, so Dynamo compiles the block once and every other block
reuses that graph (its weights are graph inputs, not constants). Compile time
is then that of one block, independent of depth, and anything the compiler
cannot capture stays local to a block. It is also the unit the other
transforms work on: recomputation (recompute.py) puts a block's forward
under ``torch.utils.checkpoint``, which Dynamo traces as a higher-order
operator, so ``--compile`` composes with every ``--recompute`` policy, and
with autocast (``--precision``), which Dynamo records into the graph.

Cost: the first forward and backward of a block pay the compilation (seconds
to tens of seconds on CPU, more for a large model); later steps reuse the
compiled code, and the Inductor cache in the temp folder makes a second run of
the same model start faster. Results differ from eager in the last bits (fused
kernels sum in another order): a compiled run matches an eager one to fp32
rounding, about 1e-6 relative, not bitwise.

``--compile-mode reduce-overhead`` (Inductor's CUDA graphs, "cudagraph trees"):
a small model's step is launch-bound, its GPU idle between the host's kernel
launches (a 124M-parameter model trained eager at 27% MFU on an H200, docs/performance.md).
A CUDA graph records a block's compiled forward (and backward) once and replays
all its kernels with one launch, into the same memory: the block's inputs are
copied into the recorded buffers, its weights read where they were recorded.
So it holds only where nothing changes between replays: fixed shapes (not
``--pack``'s per-batch document masks), weights at fixed addresses (not ZeRO-3's
gathers into fresh storage), no host sync inside a block (not a mixture of
experts' routing counts), no collective the ledger must count (not tp or ep),
and one micro-batch through a block at a time (not a pipeline's several in
flight): config_checks.py refuses each in one sentence. Every step begins with
`mark_step`, so that a replay may reuse the memory of the last step's outputs.
On a CPU the mode compiles as ``default`` does (there are no CUDA graphs to
record), so the CPU tests check that the setting trains the same numbers; its
speed is a GPU row of scripts/gpu_figures.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

COMPILE_NOTE = ("--compile: the first step compiles every distinct block graph (seconds to minutes); "
                "later steps reuse it.")


def compile_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None = None, mode: str = "default") -> None:
    """Compile each of ``model.blocks`` (or of ``blocks``, a pipeline stage's) in place, in
    ``mode`` (``reduce-overhead``: replayed as CUDA graphs, module docstring).

    ``nn.Module.compile`` keeps the module object, its parameter names and
    its ``state_dict`` keys, so checkpoints and the parallel transforms, which
    address parameters by name, see the same model.
    """
    for block in model.blocks if blocks is None else blocks:
        block.compile(mode=None if mode == "default" else mode)


def mark_step() -> None:
    """A training step begins: CUDA graphs' replays may reuse the memory of the last step's outputs."""
    torch.compiler.cudagraph_mark_step_begin()
