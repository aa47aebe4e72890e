"""Adapters that plug rollout into other training libraries.

Each submodule imports its library lazily (or not at all), so `import rollout` never needs them:
`rollout.integrations.trl.make_rollout_func` is TRL's `GRPOTrainer(rollout_func=...)`.
"""
