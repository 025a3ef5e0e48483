"""Fine-tuning a trained model: low-rank adapters trained beside its frozen
weights (LoRA, lora.py), those weights stored in 4-bit NormalFloat with double
quantization (QLoRA, nf4.py), so that the frozen part costs about a quarter of
its bf16 memory, and where a fine-tune starts from: one of our checkpoints
(base.py) or a Hugging Face model folder (hf.py)."""
