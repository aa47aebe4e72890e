"""FSDP2 in the trainers: the policy sharded per decoder layer and at the root with
`torch.distributed.fsdp.fully_shard`, the rollout engine on a full copy taken before sharding, and each
weight sync a stream of full tensors gathered one bucket (one decoder layer) at a time.

`RLConfig.fsdp` decides: True / False, or "auto" (the default): shard when the accelerator is FSDP-typed
or the accelerate launch config asked for FSDP (`distributed_type: FSDP`, which accelerate itself ignores on
a CPU: it starts plain gloo ranks, so the trainer applies `fully_shard` from the same config). The launch
config's `fsdp_config` gives the settings: `fsdp_version` (2 only), `fsdp_reshard_after_forward`,
`fsdp_offload_params` (parameters, gradients and optimizer state on the CPU; nothing to do on CPU ranks),
`fsdp_activation_checkpointing` and `transformer_cls_names_to_wrap` (default: the model's `_no_split_modules`);
`mixed_precision: bf16` becomes `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.

Memory: each rank holds its shards (parameters, gradients, AdamW state: about 1/N of DDP's), the engine's full
copy (inference weights only), and during a sync one bucket's full tensors more (`SyncStats`). The gathers
are collective: every rank syncs its own engine at the same point of the step.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from trainers.common import reduce_metrics

LAYER_NAME = re.compile(r"^(.*\.layers\.\d+)\.")  # NOTE: the bucket key of a decoder layer's tensors


@dataclass
class FSDPSettings:
    """What `fully_shard` gets (see the module docstring for where each comes from)."""

    reshard_after_forward: bool = True
    offload: bool = False
    bf16: bool = False
    activation_checkpointing: bool = False
    wrap_classes: tuple[str, ...] = ()


@dataclass
class SyncStats:
    """The last sync: its buckets, tensors, and the largest bucket's bytes of full tensors (its peak extra)."""

    buckets: int = 0
    tensors: int = 0
    peak_bucket_bytes: int = 0


def fsdp_settings(fsdp: bool | str, accelerator) -> FSDPSettings | None:
    """The settings to shard with, or None (DDP / one process as before). ValueError on FSDP version 1."""
    if fsdp is False:
        return None
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, parse_flag_from_env

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    launched = accelerator.distributed_type == DistributedType.FSDP or parse_flag_from_env("ACCELERATE_USE_FSDP")
    if fsdp == "auto" and not launched:
        return None
    if plugin is None and launched:
        plugin = FullyShardedDataParallelPlugin()  # NOTE: parses the launch config (accelerate's environment)
    if plugin is None:
        return FSDPSettings(bf16=accelerator.mixed_precision == "bf16")
    if plugin.fsdp_version != 2:
        raise ValueError(f"the trainers shard with FSDP2 only: set fsdp_version: 2 (got {plugin.fsdp_version})")
    from torch.distributed.fsdp import CPUOffloadPolicy

    return FSDPSettings(
        reshard_after_forward=bool(plugin.reshard_after_forward),
        offload=isinstance(plugin.cpu_offload, CPUOffloadPolicy),
        bf16=accelerator.mixed_precision == "bf16",
        activation_checkpointing=bool(plugin.activation_checkpointing),
        wrap_classes=tuple(plugin.transformer_cls_names_to_wrap or ()),
    )


def shard(module: torch.nn.Module, policy: torch.nn.Module, settings: FSDPSettings, device: torch.device,
          world: int) -> int:
    """`fully_shard` each decoder layer of `policy` (inside `module`), then `module` itself, in place, over
    one mesh of `world` ranks on `device`'s type; returns how many layers were wrapped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    names = set(settings.wrap_classes or getattr(policy, "_no_split_modules", None) or ())
    layers = [m for m in policy.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"FSDP: no decoder layer of {type(policy).__name__} to shard (looked for {sorted(names)}); "
                         "set fsdp_config.transformer_cls_names_to_wrap in the launch config")
    if settings.activation_checkpointing:
        if not getattr(policy, "supports_gradient_checkpointing", False):
            raise ValueError(f"fsdp_activation_checkpointing: {type(policy).__name__} has no gradient checkpointing")
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world,))
    kwargs = dict(mesh=mesh, reshard_after_forward=settings.reshard_after_forward)
    if settings.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if settings.offload and device.type != "cpu":  # NOTE: on a CPU rank everything is in host memory already
        kwargs["offload_policy"] = CPUOffloadPolicy()  # (and FSDP's offload refuses a CPU mesh)
    else:
        module.to(device)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    return len(layers)


def param_fraction(module: torch.nn.Module) -> float:
    """The share of `module`'s parameter elements held on this rank (1.0 unsharded, ~1/N under FSDP)."""
    local = total = 0
    for p in module.parameters():
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        total += p.numel()  # NOTE: a DTensor's numel is the full tensor's
    return local / max(total, 1)


def parameter_buckets(module: torch.nn.Module) -> Iterator[list[tuple[str, Tensor]]]:
    """`module`'s named parameters in order, grouped into buckets: one per decoder layer, one for each run of
    the others (embeddings; final norm and head)."""
    bucket: list[tuple[str, Tensor]] = []
    key = None
    for name, p in module.named_parameters():
        match = LAYER_NAME.match(name)
        here = match.group(1) if match else ""
        if bucket and here != key:
            yield bucket
            bucket = []
        key = here
        bucket.append((name, p))
    if bucket:
        yield bucket


def full_tensor_stream(module: torch.nn.Module, stats: SyncStats) -> Iterator[tuple[str, Tensor]]:
    """`(name, full tensor)` of every parameter of a sharded `module`, for `RolloutEngine.update_weights`:
    a bucket's tensors are gathered together (collective: every rank must consume the whole stream), then
    handed out one by one, each released once the engine has copied it; never the whole model at once."""
    stats.buckets = stats.tensors = stats.peak_bucket_bytes = 0
    with torch.no_grad():
        for bucket in parameter_buckets(module):
            full = [(name, p.full_tensor() if isinstance(p, DTensor) else p) for name, p in bucket]
            stats.buckets += 1
            stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, sum(t.numel() * t.element_size() for _, t in full))
            full.reverse()
            while full:
                stats.tensors += 1
                yield full.pop()  # NOTE: the stream's reference goes with the pop; the engine copies it


def full_state(module: torch.nn.Module) -> dict[str, Tensor]:
    """`module.state_dict()` with every sharded tensor gathered whole (collective under FSDP)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def broadcast_module(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank, in place (collective; before sharding)."""
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            torch.distributed.broadcast(t.data, src=0)


def remap_optimizer(optimizer: torch.optim.Optimizer, before: dict[int, str], module: torch.nn.Module) -> None:
    """Point `optimizer`'s param groups at `module`'s sharded parameters (`fully_shard` replaced them), by name
    (`before`: id of each old parameter -> its name). Its state must still be empty."""
    if optimizer.state:
        raise ValueError("FSDP: the optimizer has state already; pass a fresh optimizer (or none)")
    after = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [after[before[id(p)]] for p in group["params"]]


class Replicated:
    """The layout of an unsharded policy: one whole copy per process, `accelerator.prepare`d (DDP over several
    processes, the module itself in one). The base of the other layouts (`FullyShardedLayout`,
    `trainers.tensor_parallel.TensorParallelLayout`): each method says what a trainer does with the layout's
    policy, given the trainer's own `policy` (the unwrapped causal LM), `model` and `optimizer`.

    Attributes: `fsdp` (the FSDP settings, None unsharded), `tp_size`, `data_rank` / `data_world` (the
    data-parallel replica this process feeds, of how many), `param_fraction` (the share of the parameters held
    here, logged), `sync_stats` (the last sharded sync's `SyncStats`)."""

    fsdp: FSDPSettings | None = None
    tp_size: int = 1
    param_fraction: float = 1.0

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator
        self.data_rank, self.data_world = accelerator.process_index, max(1, accelerator.num_processes)
        self.sync_stats = SyncStats()

    def prepare(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: torch.nn.Module):
        """`(model, optimizer)` to train: `module` (whose causal LM is `policy`) laid out over the processes."""
        return self.accelerator.prepare(module, optimizer)

    def unsharded_policy(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The policy with full tensors (the engine's model): the trainer's own."""
        return policy

    def weight_source(self, policy: torch.nn.Module, given: bool):
        """What `engine.update_weights` copies from (`given`: the rollout is the caller's, `rollout=`)."""
        return policy

    def gather_policy(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The policy with its current weights as full tensors (collective where the layout shards)."""
        return self.unsharded_policy(policy)

    def reference_copy(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The KL reference's initial weights: a deep copy of the policy's full tensors."""
        return copy.deepcopy(self.unsharded_policy(policy))

    def save_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """What `accelerator.save_state` cannot save of a sharded model and optimizer (nothing here)."""

    def load_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """`save_shards`' counterpart."""

    def gather_replicas(self, rows: Tensor) -> Tensor:
        """`accelerator.gather(rows)`: every data-parallel replica's rows, `[n x data_world]`."""
        return self.accelerator.gather(rows)

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """`trainers.common.reduce_metrics` over the processes."""
        return reduce_metrics(self.accelerator, metrics)


class FullyShardedLayout(Replicated):
    """FSDP2 (see the module docstring): `prepare` keeps a full copy of the policy (`full_policy`, the engine's
    model), shards the module in place and remaps the optimizer; each sync streams full tensors bucket by bucket.

    Args:
        accelerator: the trainer's.
        settings: `fsdp_settings`' answer.
    """

    def __init__(self, accelerator, settings: FSDPSettings) -> None:
        super().__init__(accelerator)
        self.fsdp = settings
        self.full_policy: torch.nn.Module | None = None

    def prepare(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: torch.nn.Module):
        acc = self.accelerator
        if acc.num_processes > 1:
            broadcast_module(module.to(acc.device))  # NOTE: as DDP: every rank starts from rank 0's weights
        self.full_policy = copy.deepcopy(policy).to(acc.device).eval()  # NOTE: the engine's, before sharding
        self.full_policy.requires_grad_(False)
        before = {id(p): name for name, p in module.named_parameters()}
        shard(module, policy, self.fsdp, acc.device, acc.num_processes)
        remap_optimizer(optimizer, before, module)
        self.param_fraction = param_fraction(policy)
        return module, optimizer  # NOTE: not prepared: accelerate would wrap a CPU rank's module in DDP

    def unsharded_policy(self, policy: torch.nn.Module) -> torch.nn.Module:
        return self.full_policy

    def weight_source(self, policy: torch.nn.Module, given: bool):
        """Full tensors bucket by bucket; for a given rollout (a fleet, a pool: `rollout=`) every bucket gathered
        first, then handed over whole, so no gather interleaves with the sends."""
        stream = full_tensor_stream(policy, self.sync_stats)
        return dict(stream) if given else stream

    def gather_policy(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The full copy refreshed from the shards (collective: every rank calls it); afterwards
        `unsharded_policy` is that module."""
        targets = dict(self.full_policy.named_parameters())
        with torch.no_grad():
            for name, tensor in full_tensor_stream(policy, SyncStats()):
                targets[name].copy_(tensor)
        return self.full_policy

    def save_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """The model and optimizer as one DCP checkpoint (`path/fsdp`, each rank its shards)."""
        from trainers.checkpoints import save_sharded

        save_sharded(model, optimizer, path)

    def load_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        from trainers.checkpoints import load_sharded

        load_sharded(model, optimizer, path)


def check_fsdp_trainer(config) -> None:
    """ValueError naming the setting that does not run on an FSDP-sharded policy."""
    if config.batch_invariant:
        raise ValueError("batch_invariant does not run on FSDP-sharded parameters: use DDP (fsdp=False)")
    if config.lora_rank is not None:  # NOTE: the engine's full copy would be a second base, each sync every tensor
        raise ValueError("lora_rank does not run under FSDP yet: use DDP (fsdp=False) for LoRA")
