"""Attention backends (see `rollout.backends.registry`)."""
