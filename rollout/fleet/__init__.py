"""Many engines: pools of `rollout serve` processes behind the RolloutEngine API, and those processes."""
