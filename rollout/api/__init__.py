"""The public RL and seed APIs: `RolloutEngine`, `RolloutBatch`, `ScoreBatch`, chat-template ids, and the
transformers-compatible entry points (`generate_batch`, `init_continuous_batching`,
`continuous_batching_context_manager`)."""
