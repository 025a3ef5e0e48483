"""Fine-tuning a trained model: low-rank adapters trained beside its frozen
weights (LoRA, lora.py), those weights stored in 4-bit NormalFloat with double
quantization (QLoRA, nf4.py), so that the frozen part costs about a quarter of
its bf16 memory, and Hugging Face model folders read whole (hf.py) or slice by
slice into a split model (sliced.py). Nothing here reads a run's checkpoints:
where a fine-tune starts from (job/base_model.py) and the exports
(job/export.py, job/export_hf.py) sit above, with the checkpoints."""
