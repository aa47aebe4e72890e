"""Sampling: the per-row sampler, logits processors, the GenerationConfig field table, token / top-k /
prompt logprobs and per-row seeds."""
