"""`--tp_size N`: the GRPO recipe's policy loaded with transformers' tensor parallelism
(`DistributedConfig(tp_size=N)`) on the N ranks of one launch, which form one data-parallel replica: every rank
sees the same prompts and rollouts, the engine runs on the sharded model, the trainer trains the shards
(`trainers.tensor_parallel`). Launch (CPU: gloo; GPUs: one rank per GPU):

    torchrun --nproc-per-node 2 recipes/grpo.py --tp_size 2
    accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/grpo.py --tp_size 2
"""

from __future__ import annotations

import os


def add_tp_args(p) -> None:
    p.add_argument("--tp_size", type=int, default=1,
                   help="tensor-parallel ranks of the policy (DistributedConfig(tp_size=N)); launch N processes")


def world_size(accelerator=None) -> int:
    return accelerator.num_processes if accelerator is not None else int(os.environ.get("WORLD_SIZE", "1"))


def check_tp_args(args, accelerator=None) -> None:
    """ValueError naming the problem for a `--tp_size` the launch or the other flags cannot run (before any loading;
    the model's head counts are checked by `tp_load_kwargs`, the trainer's settings by the trainer)."""
    tp = getattr(args, "tp_size", 1)
    if tp < 1:
        raise ValueError(f"--tp_size must be >= 1, got {tp}")
    if tp == 1:
        return
    world = world_size(accelerator)
    if world % tp:
        raise ValueError(f"--tp_size {tp} does not divide the world size {world}: launch a multiple of {tp} "
                         f"processes (torchrun --nproc-per-node {tp})")
    if world != tp:
        raise ValueError(f"--tp_size {tp} on {world} processes: data parallelism over several TP groups is not "
                         "implemented yet (transformers needs dp_replicate_size for it, an HSDP model the engine "
                         f"cannot run); launch exactly {tp} processes")
    from accelerate.utils import parse_flag_from_env

    if parse_flag_from_env("ACCELERATE_USE_FSDP") or getattr(args, "fsdp", False):
        raise ValueError(f"--tp_size {tp} with FSDP: the policy is sharded by tensor parallelism already; launch "
                         "with a non-FSDP config (recipes/accelerate/2cpu.yaml) or torchrun")
    for flag, off in (("lora_rank", None), ("async_rollout", False), ("rollout_engines", 0), ("engine_dtype", None),
                      ("batch_invariant", False)):
        value = getattr(args, flag, off)
        if value != off and value:
            raise ValueError(f"--tp_size {tp} with --{flag} {value} is not supported yet")


def tp_load_kwargs(args, model_path: str) -> dict:
    """The `from_pretrained` kwargs of the policy: `distributed_config` under `--tp_size N > 1`, after checking
    that N divides the model's attention and KV head counts (ValueError naming the count)."""
    tp = getattr(args, "tp_size", 1)
    if tp == 1:
        return {}
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads",
                                                        getattr(config, "num_key_value_heads", None) or heads)):
        if value % tp:
            raise ValueError(f"--tp_size {tp} does not divide {model_path}'s {name} ({value}): each rank holds "
                             f"{name} / tp_size heads; pick a tp_size among its divisors")
    return {"distributed_config": DistributedConfig(tp_size=tp)}
