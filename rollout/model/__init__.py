"""The model side of a step: the runner (scheduler output -> packed forward -> logits), the engine's view of
a user's model, the compiled forward, and facts read off a model's config."""
