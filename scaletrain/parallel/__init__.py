"""Parallel transforms: each takes a plain model and the mesh, and returns
the pieces the trainer drives, so the training loop never changes when a
strategy is added."""
