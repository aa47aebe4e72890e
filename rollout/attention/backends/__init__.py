"""Attention backends: how the paged attention of one step runs (`ContinuousBatchingConfig.attn_backend`).

Each backend is one class in its own module that owns its per-group metadata, the builder of that
metadata and its attention, and declares what the engine asks of it (`base.AttentionBackend`):
`build_group` turns the step's inputs (`base.StepInputs`) into the tensors its kernel wants, once per
step and layer group, and `attend` runs one layer over the paged cache; `attn_memory` is its share of
the memory plan, `supports_sinks` and `reads_unwritten_slots` what it implements and needs. The runner
and the registered attention function (`rollout.attention.interface`) call those and never ask which backend
runs. The K/V of the step are written into the cache before `attend` (one code path for every
backend). Backends (`BACKENDS`):

- `cpu`: the C++ kernel of `rollout.kernels.cpu_kernels` for decode rows, SDPA for prompt chunks (`cpu`);
- `sdpa`: gather of each request's pages + torch SDPA, the portable reference (`sdpa`);
- `flex`: torch FlexAttention over the whole paged cache, compiled (`flex`);
- `flash`: flash-attn with page tables, CUDA only (`flash`; refuses to run elsewhere);
- `triton`: the Triton paged decode kernel of `rollout.kernels.triton_decode` for decode rows, SDPA for prompt
  chunks (`triton`; CUDA, or a CPU under Triton's interpreter; the `triton` extra; never picked by `"auto"`).

This module is the registry: `select` (the backend for a config, a device and a model), `resolve`
(`"auto"` alone), `attention_memory` and `create`. `"auto"` picks `cpu` on a CPU (`sdpa` when the kernel cannot
build: `rollout.kernels.cpu_kernels` has warned once, saying why) and `flex` on CUDA (`flash` there once it is
implemented); a model with attention sinks (gpt-oss) gets a backend that implements them.
"""

from __future__ import annotations

import logging

import torch

from rollout.attention.backends.base import AttentionBackend, AttentionMetadata, StepInputs
from rollout.attention.backends.cpu import CpuBackend, cpu_kernel
from rollout.attention.backends.flash import FlashBackend
from rollout.attention.backends.flex import FlexBackend
from rollout.attention.backends.sdpa import SdpaBackend
from rollout.attention.backends.triton import TritonBackend
from rollout.config import ATTN_BACKENDS
from rollout.kv.memory_plan import AttnMemory, KVShape

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "StepInputs", "attention_memory", "create",
           "resolve", "select"]

logger = logging.getLogger("rollout")

# NOTE: in order of preference where several could serve (a sink model's "auto" takes the first with sinks)
BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (CpuBackend, SdpaBackend, FlexBackend, FlashBackend, TritonBackend)
}
if set(BACKENDS) != set(ATTN_BACKENDS) - {"auto"}:  # pragma: no cover - a new backend half registered
    raise ImportError(f"rollout.config.ATTN_BACKENDS {ATTN_BACKENDS} and the backends {sorted(BACKENDS)} differ")


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`name` with "auto" resolved for `device`; ValueError naming `attn_backend` when unknown."""
    if name not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {name!r}")
    return _auto(device, dtype) if name == "auto" else name


def select(name: str, device: torch.device, dtype: torch.dtype, has_sinks: bool = False,
           model: str = "the model") -> str:
    """The backend to build for `attn_backend=name` (resolved, see `resolve`) and a model (class name
    `model`) that has attention sinks or not.

    Sinks run only on backends that declare `supports_sinks`: "auto" picks the first of them (without
    probing the others: no kernel build), any other name without them is a ValueError.
    """
    if not has_sinks:
        return resolve(name, device, dtype)
    if name not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {name!r}")
    capable = [n for n, cls in BACKENDS.items() if cls.supports_sinks]
    if name == "auto":
        logger.info("%s has attention sinks: attn_backend %r (backends implementing them: %s)",
                    model, capable[0], ", ".join(capable))
        return capable[0]
    if not BACKENDS[name].supports_sinks:
        use = " or ".join(repr(n) for n in capable)
        raise ValueError(f"attn_backend={name!r} does not implement the attention sinks of {model} "
                         f"(gpt-oss); use attn_backend={use} or 'auto'")
    return name


def attention_memory(name: str, shape: KVShape, page_size: int, max_batch_tokens: int | None,
                     softcap: bool, max_pages: int) -> AttnMemory:
    """The step temporaries of backend `name` (resolved) for the memory plan (`rollout.kv.memory_plan.plan_cache`).

    `shape`: the cache's storages; `max_pages`: the most pages one request can hold.
    """
    return BACKENDS[name].attn_memory(shape, page_size, max_batch_tokens, softcap, max_pages)


def create(name: str, device: torch.device, dtype: torch.dtype, **context) -> AttentionBackend:
    """The backend `name` (`"auto"` resolved for `device`), ready to run; ValueError naming
    `attn_backend` when it is unknown or cannot run here.

    `context`: what a backend may need from the engine (`page_size`, `num_pages`, `max_batch_tokens`).
    """
    return BACKENDS[resolve(name, device, dtype)].create(device, dtype, **context)


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":  # NOTE: "flash" once rollout.attention.backends.flash is implemented and verified
        return "flex"
    if device.type != "cpu":
        return "sdpa"
    if cpu_kernel(dtype) is None:
        # NOTE: rollout.kernels.cpu_kernels has said why (disabled, no compiler, failed build)
        logger.info("attn_backend='auto': rollout's CPU attention kernel is unavailable; using 'sdpa'")
        return "sdpa"
    return "cpu"
