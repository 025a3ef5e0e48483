"""A Hugging Face transformers model, as transformers builds it, trained with ZeRO-3 over dp.

    python examples/hf_causal_lm.py                                  one process
    scaletrain run --nproc 2 examples/hf_causal_lm.py --zero 3       its weights sharded over two
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py --zero 3

The model object is whatever ``AutoModelForCausalLM.from_config`` returns:
scaletrain needs no plan for data parallelism or ZeRO (its units are the
decoder layers, found as the model's repeated blocks) and calls its forward
as the model defines it.
"""

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

import scaletrain

parser = argparse.ArgumentParser()
for flag, default in (("--steps", 20), ("--batch", 16), ("--zero", 3), ("--seq", 64)):
    parser.add_argument(flag, type=int, default=default)
parser.add_argument("--text", default=argparse.__file__, help="a text file to learn, byte by byte")
parser.add_argument("--out", default="runs/hf-causal-lm")
args = parser.parse_args()

config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)

engine = scaletrain.setup(model, zero=args.zero, lr=3e-3, steps=args.steps, warmup_steps=2)
data = torch.tensor(list(Path(args.text).read_bytes()), dtype=torch.long)
windows = [data[i:i + args.seq + 1] for i in range(0, len(data) - args.seq - 1, args.seq)]
per_rank = args.batch // engine.data_ranks
loader = DataLoader(windows, batch_size=per_rank, sampler=engine.sampler(len(windows), per_rank))

curve = []
for window in loader:  # to step args.steps, where the engine's sampler ends
    window = window.to(engine.device)
    logits = engine(input_ids=window[:, :-1]).logits
    engine.backward(engine.cross_entropy(logits, window[:, 1:]))
    curve.append(engine.step()["loss"])

if engine.is_main:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "losses.json").write_text(json.dumps(curve))
    print(f"step {len(curve)}: loss {curve[-1]:.4f}")
engine.save(args.out)
engine.close()
