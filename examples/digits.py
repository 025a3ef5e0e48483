"""A digits classifier, made data parallel with scaletrain: the lines marked # scaletrain.

    python examples/digits.py --out runs/digits                        one process
    scaletrain run --nproc 2 examples/digits.py --out runs/digits-dp2  two, the same global batch
    torchrun --nproc-per-node 2 examples/digits.py --out runs/digits-dp2

Each step reads a global batch of --batch images, split over the processes;
the learning curve is the same for any number of them (tests/test_examples.py).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import scaletrain  # scaletrain

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch", type=int, default=64, help="images per step, over all processes")
parser.add_argument("--zero", type=int, default=0)
parser.add_argument("--out", default="runs/digits")
args = parser.parse_args()

images, labels = load_digits(return_X_y=True)
dataset = TensorDataset(torch.tensor(images, dtype=torch.float32) / 16, torch.tensor(labels))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

engine = scaletrain.setup(model, zero=args.zero, lr=0.01, steps=args.steps, warmup_steps=5)  # scaletrain
per_rank = args.batch // engine.data_ranks  # scaletrain: each rank reads its share of the batch
loader = DataLoader(dataset, batch_size=per_rank, sampler=engine.sampler(len(dataset), per_rank))  # scaletrain

curve = []
for x, y in loader:  # scaletrain: the sampler ends after steps=args.steps
    x, y = x.to(engine.device), y.to(engine.device)
    loss = F.cross_entropy(engine(x), y)  # scaletrain: engine(x) in place of model(x)
    engine.backward(loss)                 # scaletrain: in place of loss.backward()
    curve.append(engine.step()["loss"])   # scaletrain: in place of optimizer.step(); the global batch's loss

if engine.is_main:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "losses.json").write_text(json.dumps(curve))
    print(f"step {len(curve)}: loss {curve[-1]:.4f}")
engine.save(args.out)  # scaletrain: every rank writes its part
engine.close()
