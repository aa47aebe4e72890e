"""`--rollout_engines N`: the GRPO recipe's rollouts from a Ray fleet of N engine actors (`rollout.fleet.RolloutFleet`,
the `[ray]` extra) instead of an engine in the learner's process.

Each learner process builds its own fleet of N engines on the same checkpoint the policy was loaded from; with
`--ray_address` they all join one cluster (`ray start --head` on one node, `ray start --address HEAD:6379` on the
others), else one process starts a local cluster of `N x --engine_cpus` CPUs on 127.0.0.1."""

from __future__ import annotations

from _common import refuse


def add_fleet_args(p) -> None:
    p.add_argument("--rollout_engines", type=int, default=0,
                   help="rollouts from a Ray fleet of this many engine actors (0: an engine in this process)")
    p.add_argument("--ray_address", default=None, help="the Ray cluster to join (default: start a local one)")
    p.add_argument("--engine_cpus", type=float, default=1.0, help="CPUs of each engine actor")
    p.add_argument("--engine_gpus", type=float, default=0.0, help="GPUs of each engine actor")


def build_fleet(args, model_path: str, tokenizer, engine_config, accelerator):
    """The fleet `--rollout_engines` asks for (None for 0)."""
    if not args.rollout_engines:
        return None
    if accelerator.num_processes > 1 and args.ray_address is None:
        raise refuse("--rollout_engines with several learner processes needs --ray_address (one Ray cluster "
                     "for all of them: start it with `ray start --head`)")
    from rollout.fleet import RolloutFleet

    resources = {"CPU": args.engine_cpus, **({"GPU": args.engine_gpus} if args.engine_gpus else {})}
    # NOTE: no tokenizer: each engine loads model_path's own (the recipe's too); a hub model's tokenizer is large
    # enough that Ray would put it in its object store and log an error line about the actor's restarts
    return RolloutFleet(model_path, num_engines=args.rollout_engines, engine_config=engine_config,
                        resources_per_engine=resources, address=args.ray_address)
