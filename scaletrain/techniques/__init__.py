"""Single-device techniques, each applied to a plain model on one device and composing with every
parallel transform: mixed precision and loss scaling (precision.py), activation recompute
(recompute.py), torch.compile of the blocks (compile.py), and saved activations stored
compressed (compress_activations.py)."""
