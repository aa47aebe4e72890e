"""Many engines: pools of `rollout serve` processes (`pool.RolloutPool`) and fleets of Ray engine actors
(`RolloutFleet`, the `[ray]` extra) behind the RolloutEngine API, and the server processes.

`from rollout.fleet import RolloutFleet` works without Ray; building one without it raises an ImportError
naming the extra."""


def __getattr__(name: str):
    if name == "RolloutFleet":  # NOTE: lazy, so importing the package never needs torch or ray
        from rollout.fleet.ray_fleet import RolloutFleet

        return RolloutFleet
    raise AttributeError(f"module 'rollout.fleet' has no attribute {name!r}")


__all__ = ["RolloutFleet"]
