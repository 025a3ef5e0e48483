"""The planner against a published table: Megatron-LM's weak scaling on A100s.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (arXiv 2104.04473), Table 1: models of 1.7B to
1T parameters on 32 to 3,072 A100s (80 GB, 8 a node, one 200 Gb/s HDR
InfiniBand port per GPU), sequence 2,048, vocabulary 51,200, full activation
recomputation, fp16. The layouts are the paper's scripts
(examples/sc21/run_table_1.sh in NVIDIA/Megatron-LM at commit 6985e58): tp,
pp, micro-batch, global batch and, where given, the interleaved schedule's
layers per virtual stage. The paper counts an iteration's FLOPs as

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))

(its Section 5.1: the forward, the recomputed forward and backward's two), and
its achieved TFLOP/s per GPU is F over the measured iteration time and the
GPUs. The prediction is the same F over the planner's step time
(planner/predict.py) for the same layout on an A100 that runs attention as
the paper's software did, its scores materialised (planner/compute.py).

    python -m scaletrain.planner.published
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scaletrain.config import Config
from scaletrain.planner.hardware import DEVICES, Cluster
from scaletrain.planner.predict import predict

SEQ = 2048
VOCAB = 51_200
GPUS_PER_NODE = 8
# 2021's Megatron-LM computed attention unfused: the scores and probabilities written out
PAPER_A100 = dataclasses.replace(DEVICES["A100"], materialized_attention=True)


@dataclass(frozen=True)
class Row:
    """One row of Table 1 and the layout its script ran."""

    params: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    virtual: int  # the interleaved schedule's stages per rank (1: plain 1F1B)
    tflops: float  # achieved teraFLOP/s per GPU

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def flops(self) -> float:
        """The paper's FLOPs of one iteration (module docstring)."""
        s, h, layers = SEQ, self.hidden, self.layers
        return 96 * self.batch * s * layers * h * h * (1 + s / (6 * h) + VOCAB / (16 * layers * h))

    def config(self) -> Config:
        micro_batches = self.batch // (self.micro_batch * self.dp)
        fields = dict(n_layers=self.layers, d_model=self.hidden, n_heads=self.heads, seq_len=SEQ, tp=self.tp,
                      pp=self.pp, dp=self.dp, micro_batch=self.micro_batch, recompute="full", precision="fp16")
        if self.pp == 1:
            return Config().replace(**fields, grad_accum=micro_batches)
        schedule = "interleaved" if self.virtual > 1 else "1f1b"
        return Config().replace(**fields, grad_accum=1, microbatches=micro_batches, pp_schedule=schedule,
                                virtual_stages=self.virtual)

    def predicted_tflops(self) -> float:
        """The paper's FLOPs over the planner's step time, per GPU."""
        step = predict(self.config(), self.gpus, VOCAB, Cluster(PAPER_A100, self.gpus, GPUS_PER_NODE)).time["step"]
        return self.flops / step / self.gpus / 1e12


# params, heads, hidden, layers, tp, pp, GPUs, global batch, micro-batch, stages per rank, TFLOP/s per GPU
TABLE_1 = (
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    Row("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
)


def table() -> str:
    """Table 1 beside the planner's prediction, as markdown."""
    lines = ["| model | tp | pp | GPUs | batch | paper TFLOP/s | predicted | predicted / paper |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in TABLE_1:
        predicted = row.predicted_tflops()
        lines.append(f"| {row.params} | {row.tp} | {row.pp} | {row.gpus:,} | {row.batch:,} | {row.tflops:.0f} "
                     f"| {predicted:.1f} | {predicted / row.tflops:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
