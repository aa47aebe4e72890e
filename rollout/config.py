"""`ContinuousBatchingConfig`: every knob of the engine, validated once at construction."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("rollout")

SCHEDULER_TYPES = ("fifo", "prefill_first")
LOGPROBS_MODES = ("processed", "raw")
ATTN_BACKENDS = ("auto", "cpu", "sdpa", "flex", "flash")  # NOTE: rollout.backends implements each
# NOTE: the seed's defaults for the safety margin depend on the scheduler.
DEFAULT_SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0}


@dataclass(slots=True)
class ContinuousBatchingConfig:
    """Configuration of the continuous-batching engine (field names and defaults follow transformers').

    Args:
        page_size: tokens per KV page (>= 4).
        num_blocks: pages in the KV cache; None sizes it from memory (see `rollout.memory_plan.plan_cache`).
        max_memory_percent: share of the free memory the cache may take; in (0, 1]. On a GPU the default
            0.8 of its free memory. On a CPU the cache shares host RAM with the trainer, so unless set
            explicitly it takes min(5% of the available RAM, 1 GiB); an explicit value is that share of
            the available RAM.
        max_batch_tokens: query-token budget of one forward; None = 8192 bounded by memory, never < 256.
        max_requests_per_batch: cap on requests per forward; None = bounded by the token budget.
        scheduler_type: "fifo" (running requests first) or "prefill_first".
        safety_margin: share of the cache kept free for running requests before admitting new ones;
            None = 0.15 for fifo, 0.0 for prefill_first; in [0, 1).
        return_logprobs: record one fp32 logprob per generated token.
        logprobs_mode: "processed" (under the distribution actually sampled) or "raw" (log_softmax of logits).
        allow_block_sharing: prefix caching of full pages across requests.
        per_request_processors: honour per-request temperature / top_k / top_p.
        cpu_offload_space: GiB of host memory to park evicted pages in (0 disables; None sizes it from
            `cpu_offload_space_safety_threshold` of available RAM).
        attn_backend: how paged attention runs: "auto" (default: "cpu" on a CPU, "flash" else "flex"
            on CUDA), "cpu" (C++ kernels), "sdpa" (gather + torch SDPA, any device), "flex" (compiled
            FlexAttention over the paged cache), "flash" (flash-attn, CUDA). See `rollout.backends`.
        default_compile_level: 0 (default) runs the forward eagerly; 1-3 (all the same here) compile it on
            a CPU as one graph (`rollout.compiled`: seconds to a minute once per process and thread count,
            faster steps after); no effect on other devices.
        use_cuda_graph, q_padding_interval_size, kv_padding_interval_size, use_async_batching,
        varlen_compile_config, decode_compile_config, max_blocks_per_request,
        cpu_group_timeout, auto_switch_to_flash: accepted for API compatibility with transformers;
            the ones that need CUDA log once that they have no effect on a CPU.
    """

    page_size: int = 256
    num_blocks: int | None = None
    max_memory_percent: float = 0.8
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    logprobs_mode: str = "processed"
    allow_block_sharing: bool = True
    per_request_processors: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    use_cuda_graph: bool = False
    q_padding_interval_size: int = 64
    kv_padding_interval_size: int = 16384
    use_async_batching: bool = False
    default_compile_level: int = 0
    varlen_compile_config: Any = None
    decode_compile_config: Any = None
    max_blocks_per_request: int | None = None
    cpu_group_timeout: float = 600.0
    auto_switch_to_flash: bool = True
    attn_backend: str = "auto"
    _gpu_notes_logged: bool = field(default=False, init=False, repr=False, compare=False)
    # NOTE: whether `max_memory_percent` was given (the CPU default differs from the GPU one's 0.8).
    memory_percent_set: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int(self, "page_size", minimum=4)
        _check_int(self, "num_blocks", minimum=1, optional=True)
        _check_float(self, "max_memory_percent", low=0.0, high=1.0, low_open=True)
        _check_int(self, "max_batch_tokens", minimum=1, optional=True)
        _check_int(self, "max_requests_per_batch", minimum=1, optional=True)
        if self.scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(f"scheduler_type must be one of {SCHEDULER_TYPES}, got {self.scheduler_type!r}")
        if self.safety_margin is None:
            self.safety_margin = DEFAULT_SAFETY_MARGIN[self.scheduler_type]
        _check_float(self, "safety_margin", low=0.0, high=1.0, high_open=True)
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        for name in (
            "return_logprobs",
            "allow_block_sharing",
            "per_request_processors",
            "use_cuda_graph",
            "use_async_batching",
            "auto_switch_to_flash",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cpu_offload_space is not None:
            _check_float(self, "cpu_offload_space", low=0.0, high=math.inf)
        _check_float(self, "cpu_offload_space_safety_threshold", low=0.0, high=1.0, low_open=True)
        _check_int(self, "q_padding_interval_size", minimum=1)
        _check_int(self, "kv_padding_interval_size", minimum=1)
        _check_int(self, "default_compile_level", minimum=0)
        if self.default_compile_level > 3:
            raise ValueError(f"default_compile_level must be in 0..3, got {self.default_compile_level}")
        _check_int(self, "max_blocks_per_request", minimum=0, optional=True)
        _check_float(self, "cpu_group_timeout", low=0.0, high=math.inf, low_open=True)
        if self.use_async_batching and not self.use_cuda_graph:
            raise ValueError("use_async_batching requires use_cuda_graph=True (as in transformers)")

    def replace(self, **changes: Any) -> ContinuousBatchingConfig:
        """A validated copy with some fields changed."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        if "scheduler_type" in changes and "safety_margin" not in changes:
            fields["safety_margin"] = None
        if not self.memory_percent_set:
            del fields["max_memory_percent"]
        fields.update(changes)
        return ContinuousBatchingConfig(**fields)

    def log_unavailable_features(self, has_cuda: bool) -> None:
        """Say once which GPU-only fields cannot take effect on this machine."""
        if self._gpu_notes_logged:
            return
        self._gpu_notes_logged = True
        if self.varlen_compile_config or self.decode_compile_config:
            # NOTE: `default_compile_level >= 1` compiles the whole forward on a CPU (rollout.compiled); the
            # per-shape CompileConfigs of transformers are not used.
            logger.warning("varlen_compile_config / decode_compile_config are accepted but not applied by rollout's "
                           "engine; default_compile_level >= 1 compiles the engine forward on a CPU")
        if has_cuda:
            return
        ignored = [n for n in ("use_cuda_graph", "use_async_batching") if getattr(self, n)]
        if ignored:
            logger.warning("%s need CUDA and have no effect on this CPU-only machine", ", ".join(ignored))


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(ContinuousBatchingConfig) if f.init)
_dataclass_init = ContinuousBatchingConfig.__init__
_MEMORY_PERCENT_POSITION = [f.name for f in dataclasses.fields(ContinuousBatchingConfig) if f.init].index(
    "max_memory_percent")


def _init_naming_unknown_fields(self: ContinuousBatchingConfig, *args: Any, **kwargs: Any) -> None:
    unknown = sorted(set(kwargs) - _FIELD_NAMES)
    if unknown:
        raise ValueError(f"unknown ContinuousBatchingConfig field(s): {', '.join(unknown)}")
    _dataclass_init(self, *args, **kwargs)
    self.memory_percent_set = "max_memory_percent" in kwargs or len(args) > _MEMORY_PERCENT_POSITION


# NOTE: unknown fields raise ValueError (naming them) rather than the dataclass's TypeError.
ContinuousBatchingConfig.__init__ = _init_naming_unknown_fields  # type: ignore[method-assign]


def _check_int(cfg: ContinuousBatchingConfig, name: str, minimum: int, optional: bool = False) -> None:
    value = getattr(cfg, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(
    cfg: ContinuousBatchingConfig,
    name: str,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        lb = "(" if low_open else "["
        hb = ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lb}{low}, {high}{hb}, got {value}")
