"""Batch-invariant mode: its ops, its attention, the engine-side mode and the trainer-side forward."""
