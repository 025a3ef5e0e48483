"""A transformer written here, not scaletrain's, split by its own plan.

    python examples/transformer.py                                     one process
    scaletrain run --nproc 2 examples/transformer.py --tp 2            Megatron tensor parallelism
    scaletrain run --nproc 4 examples/transformer.py --tp 2 --zero 3   ... and ZeRO-3 over dp 2
    torchrun --nproc-per-node 2 examples/transformer.py --pp 2         a 1F1B pipeline

It learns bytes of a text file. PLAN says which of its layers tensor
parallelism splits (the attention reads its head count from its weight, so a
rank's slice runs the same code), where a pipeline may cut it, and which
module takes positions; ZeRO-3 needs nothing (its units are the blocks).
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import scaletrain
from scaletrain import Column, ModelPlan, PositionEmbedding, Region, Row, StagePlan, VocabEmbedding, VocabHead


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.core = scaletrain.CausalAttention(0.0)  # causal softmax attention; ring attention under cp

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)  # this rank's heads
        return self.proj(self.core(q, k, v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, layers: int = 4, seq: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def embed(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def unembed(self, x):
        return self.head(self.norm(x))

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


PLAN = ModelPlan(
    tensor=(("tok", VocabEmbedding()), ("pos", PositionEmbedding()),
            ("blocks.*.attn", Region()), ("blocks.*.attn.qkv", Column(parts=3)), ("blocks.*.attn.proj", Row()),
            ("blocks.*.mlp", Region()), ("blocks.*.mlp.fc", Column()), ("blocks.*.mlp.out", Row()),
            ("head", VocabHead())),
    stages=StagePlan(stack="blocks", first=("tok", "pos"), last=("norm", "head"), enter="embed", leave="unembed"),
    width=64, position_modules=("pos",))


def windows(path: str, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The file's bytes cut into (inputs, targets) windows of ``seq`` bytes."""
    data = torch.tensor(list(Path(path).read_bytes()), dtype=torch.long)
    return [(data[i:i + seq], data[i + 1:i + seq + 1]) for i in range(0, len(data) - seq - 1, seq)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag, default in (("--steps", 20), ("--batch", 16), ("--tp", 1), ("--pp", 1), ("--zero", 0)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--text", default=argparse.__file__, help="a text file to learn")
    parser.add_argument("--out", default="runs/transformer")
    args = parser.parse_args()

    torch.manual_seed(0)
    engine = scaletrain.setup(Transformer(), plan=PLAN, tp=args.tp, pp=args.pp, zero=args.zero, lr=3e-3,
                              steps=args.steps, warmup_steps=2)
    per_rank = args.batch // (engine.data_ranks * engine.micro_batches_per_step)
    data = windows(args.text, 64)
    batches = iter(DataLoader(data, batch_size=per_rank, sampler=engine.sampler(len(data), per_rank)))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    log = open(Path(args.out, "metrics.jsonl"), "w") if engine.is_main else None
    for step in range(args.steps):
        micro_batches = [next(batches) for _ in range(engine.micro_batches_per_step)]
        record = engine.train_step(micro_batches, engine.cross_entropy)  # step, loss, grad_norm, lr
        if log:
            log.write(json.dumps(record) + "\n")
    if log:
        log.close()
        print(f"step {record['step']}: loss {record['loss']:.4f}")
    engine.save(args.out)
    engine.close()
