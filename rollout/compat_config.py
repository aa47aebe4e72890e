"""The transformers-compatibility fields of `ContinuousBatchingConfig`, documented in one place.

rollout accepts every field of transformers' `ContinuousBatchingConfig` so that code written for
transformers' continuous batching runs unchanged. The fields below are accepted and validated
(`rollout.config` declares them, with their defaults and rules, in transformers' field order); most have no
effect on rollout's engine, the compile configs and `max_blocks_per_request` shape its static decode step
(`rollout.model.static_decode`). `COMPAT_FIELDS` says, for each, what it does in transformers (why
it is accepted) and what it does here; `log_unavailable_features` is the one place that says so at
run time. `use_cuda_graph` and `use_async_batching` have their meaning on CUDA; they stay fields of the
config. `cpu_group_timeout` came from the same list and has its meaning (it bounds the tensor-parallel
CPU group, `rollout.engine.tp`), so it is declared in `rollout.config` with the engine's own fields.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("rollout")


@dataclass(frozen=True, slots=True)
class CompatField:
    """One accepted-for-compatibility field: `transformers` is what it does there, `here` what it does in
    rollout. `note`: when `log_unavailable_features` mentions it: "cuda" (set on a machine without CUDA),
    or None (never)."""

    transformers: str
    here: str
    note: str | None = None


COMPAT_FIELDS: dict[str, CompatField] = {
    "use_cuda_graph": CompatField(
        "captures the step in CUDA graphs (padded to fixed shapes)",
        "on CUDA with attn_backend 'triton', decode steps run static and each bucket is captured in a CUDA graph "
        "and replayed (rollout.model.static_decode; written, NOT yet verified on a GPU); when True without CUDA, "
        "a warning that it needs CUDA",
        note="cuda",
    ),
    "q_padding_interval_size": CompatField(
        "pads a step's query tokens to a multiple of it, to bound the CUDA graph shapes",
        "nothing (no CUDA graphs); validated as an int >= 1",
    ),
    "kv_padding_interval_size": CompatField(
        "pads a step's KV length to a multiple of it, to bound the CUDA graph shapes",
        "nothing (no CUDA graphs); validated as an int >= 1",
    ),
    "use_async_batching": CompatField(
        "double-buffers the step inputs so batch preparation on the CPU overlaps the GPU step",
        "on CUDA the host schedules and queues step k+1 before it reads step k's tokens, which reach step k+1's "
        "inputs on the device (rollout.engine.async_steps: the synchronous engine's outputs; written, NOT yet run on "
        "a GPU); off under tensor parallelism or speculative decoding; as in transformers it requires "
        "use_cuda_graph=True (ValueError); when True without CUDA, a warning that it needs CUDA",
        note="cuda",
    ),
    "varlen_compile_config": CompatField(
        "the CompileConfig of the varlen (prefill) forward",
        "compiles the general (non-decode) steps with it (rollout.model.compiled); without it "
        "default_compile_level >= 1 supplies the dynamic whole-forward graph on a CPU",
    ),
    "decode_compile_config": CompatField(
        "the CompileConfig of the decode fast-path forward",
        "makes decode-only steps static (rows padded to buckets, persistent buffers, rollout.model.static_decode) "
        "and compiles one graph per bucket with it; needs attn_backend 'cpu' or 'triton'",
    ),
    "max_blocks_per_request": CompatField(
        "sizes the block table of the flash_attn_with_kvcache decode fast path (0 disables that path)",
        "the page-table width of the static decode step (default: the model's context in pages, else 32); "
        "0 turns static decode off; a step whose request holds more pages runs the general path",
    ),
    "auto_switch_to_flash": CompatField(
        "switches a model's sdpa/eager attention to flash attention when available",
        "nothing: rollout runs its own paged attention, chosen by attn_backend; validated as a bool",
    ),
}

_CUDA_FIELDS = tuple(name for name, f in COMPAT_FIELDS.items() if f.note == "cuda")
# NOTE: the notes already logged in this process: each says the same for every engine, so it is said once
# per process (not once per engine or config object: an RL loop builds many engines, and a config holds no
# logging state). Keyed by the message, which names the fields it is about.
LOGGED: set[str] = set()


def log_unavailable_features(config: Any, has_cuda: bool) -> None:
    """Warn (once per process per message) about the compat fields of `config` that are set but cannot
    take effect: GPU-only ones on a machine without CUDA."""
    if has_cuda:
        return
    ignored = [name for name in _CUDA_FIELDS if getattr(config, name)]
    if ignored:
        _warn_once(f"{', '.join(ignored)} need CUDA and have no effect on this CPU-only machine")


def _warn_once(message: str) -> None:
    if message not in LOGGED:
        LOGGED.add(message)
        logger.warning("%s", message)
