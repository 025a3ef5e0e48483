"""Fine-tuning a frozen base model: low-rank adapters (LoRA) trained beside it,
and the base's weights stored in 4-bit NormalFloat with double quantization
(QLoRA), so that the frozen part costs about a quarter of its bf16 memory."""
