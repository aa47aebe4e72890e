"""`ContinuousBatchingConfig`: every knob of the engine, validated once at construction.

This module owns the config's fields (names, defaults and positional order follow transformers'), the
rule each field is checked against, the defaults derived from other fields (`safety_margin` from the
scheduler), `memory_percent_set`, and `replace`. Each field declares its rule next to its default
(`_setting` / `_compat`); one small validator per kind of rule (`Int`, `Number`, `OneOf`, `Bool`) checks
it. The fields accepted only for compatibility with transformers are documented, and their run-time
notes logged, in `rollout.compat_config`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from rollout import compat_config

SCHEDULER_TYPES = ("fifo", "prefill_first")
LOGPROBS_MODES = ("processed", "raw")
ATTN_BACKENDS = ("auto", "cpu", "sdpa", "flex", "flash", "triton")  # NOTE: rollout.attention.backends implements each
# NOTE: each runs rollout.invariant.attention in the mode ("triton": its Triton kernels, rollout.invariant.mode)
BATCH_INVARIANT_BACKENDS = ("auto", "cpu", "sdpa", "triton")
# NOTE: the seed's defaults for the safety margin depend on the scheduler.
DEFAULT_SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0}
SEED_STREAMS = ("auto", "generator", "counter")  # NOTE: rollout.sampling.sampler draws seeded rows either way


# ---------------------------------------------------------------------------------- the rules
# Each raises a ValueError naming the field; `optional` lets None through.
@dataclass(frozen=True, slots=True)
class Int:
    """An int (not a bool) >= `low`, and <= `high` when given."""

    low: int
    high: int | None = None
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value < self.low:
            raise ValueError(f"{name} must be >= {self.low}, got {value}")
        if self.high is not None and value > self.high:
            raise ValueError(f"{name} must be in {self.low}..{self.high}, got {value}")


@dataclass(frozen=True, slots=True)
class Number:
    """An int or float (not a bool, not NaN) in the interval from `low` to `high`, each end open or closed."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"{name} must be a number, got {value!r}")
        too_low = value <= self.low if self.low_open else value < self.low
        too_high = value >= self.high if self.high_open else value > self.high
        if too_low or too_high:
            lb = "(" if self.low_open else "["
            hb = ")" if self.high_open else "]"
            raise ValueError(f"{name} must be in {lb}{self.low}, {self.high}{hb}, got {value}")


@dataclass(frozen=True, slots=True)
class OneOf:
    """One of `choices` (compared with ==)."""

    choices: tuple[str, ...]

    def check(self, name: str, value: Any) -> None:
        if value not in self.choices:
            raise ValueError(f"{name} must be one of {self.choices}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Bool:
    """True or False (not 0 / 1, not None)."""

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")


def _setting(default: Any, rule: Int | Number | OneOf | Bool | None) -> Any:
    """A field with its rule (None: any value)."""
    return field(default=default, metadata={"rule": rule})


def _compat(default: Any, rule: Int | Number | OneOf | Bool | None) -> Any:
    """A field accepted for compatibility with transformers (documented in `rollout.compat_config`)."""
    return field(default=default, metadata={"rule": rule, "compat": True})


_UNIT = Number(0.0, 1.0, low_open=True)  # (0, 1]


# ---------------------------------------------------------------------------------- the fields
@dataclass(slots=True)
class _ConfigFields:
    """The fields of `ContinuousBatchingConfig` and their checks (see that class)."""

    page_size: int = _setting(256, Int(4))
    num_blocks: int | None = _setting(None, Int(1, optional=True))
    max_memory_percent: float = _setting(0.8, _UNIT)
    max_batch_tokens: int | None = _setting(None, Int(1, optional=True))
    max_requests_per_batch: int | None = _setting(None, Int(1, optional=True))
    scheduler_type: str = _setting("fifo", OneOf(SCHEDULER_TYPES))
    # NOTE: None until __post_init__ resolves it from the scheduler (DEFAULT_SAFETY_MARGIN).
    safety_margin: float | None = _setting(None, Number(0.0, 1.0, high_open=True, optional=True))
    return_logprobs: bool = _setting(False, Bool())
    logprobs_mode: str = _setting("processed", OneOf(LOGPROBS_MODES))
    allow_block_sharing: bool = _setting(True, Bool())
    per_request_processors: bool = _setting(True, Bool())
    cpu_offload_space: float | None = _setting(0.0, Number(0.0, math.inf, optional=True))
    cpu_offload_space_safety_threshold: float = _setting(0.8, _UNIT)
    use_cuda_graph: bool = _compat(False, Bool())
    q_padding_interval_size: int = _compat(64, Int(1))
    kv_padding_interval_size: int = _compat(16384, Int(1))
    use_async_batching: bool = _compat(False, Bool())
    default_compile_level: int = _setting(0, Int(0, 3))
    varlen_compile_config: Any = _compat(None, None)
    decode_compile_config: Any = _compat(None, None)
    max_blocks_per_request: int | None = _compat(None, Int(0, optional=True))
    cpu_group_timeout: float | None = _setting(600.0, Number(0.0, math.inf, low_open=True, optional=True))
    auto_switch_to_flash: bool = _compat(True, Bool())
    attn_backend: str = _setting("auto", OneOf(ATTN_BACKENDS))
    batch_invariant: bool = _setting(False, Bool())
    seed_stream: str = _setting("auto", OneOf(SEED_STREAMS))
    max_loras: int = _setting(0, Int(0))  # NOTE: LoRA adapter slots (rollout.model.lora); 0: no adapters
    max_lora_rank: int = _setting(16, Int(1))
    speculative_method: str | None = _setting(None, OneOf((None, "ngram")))
    num_speculative_tokens: int = _setting(0, Int(0, 32))
    # NOTE: whether `max_memory_percent` was given (the CPU default differs from the GPU one's 0.8); set by
    # ContinuousBatchingConfig.__init__.
    memory_percent_set: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            rule = f.metadata.get("rule")
            if rule is not None:
                rule.check(f.name, getattr(self, f.name))
        if self.safety_margin is None:
            self.safety_margin = DEFAULT_SAFETY_MARGIN[self.scheduler_type]
        if self.batch_invariant and (self.attn_backend not in BATCH_INVARIANT_BACKENDS or self.default_compile_level):
            raise ValueError(f"batch_invariant=True runs with attn_backend in {BATCH_INVARIANT_BACKENDS} and "
                             f"default_compile_level=0, got attn_backend={self.attn_backend!r}, "
                             f"default_compile_level={self.default_compile_level}")
        if (self.speculative_method is None) != (self.num_speculative_tokens == 0):
            raise ValueError("speculative_method='ngram' needs num_speculative_tokens >= 1 and the other way round, "
                             f"got {self.speculative_method!r} and {self.num_speculative_tokens}")
        if self.use_async_batching and not self.use_cuda_graph:
            raise ValueError("use_async_batching requires use_cuda_graph=True (as in transformers)")


_INIT_FIELDS = tuple(f.name for f in dataclasses.fields(_ConfigFields) if f.init)
_MEMORY_PERCENT_POSITION = _INIT_FIELDS.index("max_memory_percent")
COMPAT_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(_ConfigFields) if f.metadata.get("compat"))


class ContinuousBatchingConfig(_ConfigFields):
    """Configuration of the continuous-batching engine (field names and defaults follow transformers').

    Every bad value, and every unknown field name, is a ValueError naming the field.

    Args:
        page_size: tokens per KV page (>= 4).
        num_blocks: pages in the KV cache; None sizes it from memory (see `rollout.kv.memory_plan.plan_cache`).
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
        per_request_processors: honour per-request sampling fields (temperature, top_k, top_p and the logits
            processors of `rollout.sampling.sampling_fields`); False: every request samples with the generation config.
        cpu_offload_space: GiB of host memory to park evicted pages in (0 disables; None sizes it from
            `cpu_offload_space_safety_threshold` of available RAM).
        attn_backend: how paged attention runs: "auto" (default: "cpu" on a CPU, or "sdpa" with a warning
            when its C++ kernel cannot build; "flex" on CUDA; "sdpa" on other devices), "cpu" (C++
            kernels), "sdpa" (gather + torch SDPA, any device), "flex" (compiled FlexAttention over the
            paged cache), "flash" (flash-attn on CUDA: not implemented yet, refused with a ValueError),
            "triton" (Triton paged decode kernel; CUDA, or a CPU under TRITON_INTERPRET=1; the triton extra).
            See `rollout.attention.backends`.
        batch_invariant: a request's tokens and logprobs bitwise identical whatever else is batched with it
            (`rollout.invariant.mode`): fp32 or bf16, attn_backend "auto" / "cpu" / "sdpa" / "triton", no compile;
            rollout's C++ kernels on a CPU, Triton kernels on CUDA (and for "triton" on a CPU, interpreted).
        seed_stream: how seeded rows draw their noise (`rollout.sampling.sampler`): "generator" (one
            `torch.Generator` per seeded request), "counter" (the counter-based Philox generator of
            `rollout.sampling.seeding`: one vectorised draw for every seeded row, the same bits on CPU and CUDA), or
            "auto" (default: "counter" on CUDA, "generator" elsewhere, so seeded CPU samples stay what they were).
            Either is reproducible per seed across batch compositions; they give different samples.
        speculative_method, num_speculative_tokens: "ngram" and k >= 1 drafts up to k tokens per decoding row from
            n-grams of its own context, its group's and its prompt's earlier rollouts, verified in one forward
            (lossless: `rollout.engine.speculation`); None and 0 (default) decode one token per step.
        default_compile_level: 0 (default) runs the forward eagerly; 1-3 (all the same here) compile it on
            a CPU as one graph (`rollout.model.compiled`: seconds to a minute once per process and thread count,
            faster steps after); no effect on other devices.
        max_loras: LoRA adapters the engine holds at once (`add_lora`; 0, the default: none), each served unmerged
            beside the base linears, many per step (`rollout.model.lora`).
        max_lora_rank: the largest rank an adapter may have (default 16, as vLLM's).
        cpu_group_timeout: seconds a collective of the tensor-parallel CPU group may block before the rank
            raises (`rollout.engine.tp`); None waits forever.
        use_cuda_graph, q_padding_interval_size, kv_padding_interval_size, use_async_batching,
        varlen_compile_config, decode_compile_config, max_blocks_per_request,
        auto_switch_to_flash: accepted (and validated) for API compatibility with
            transformers, most without effect here (decode_compile_config / varlen_compile_config compile their
            path, max_blocks_per_request sizes the static decode step): `rollout.compat_config` says what each
            does there and here.
    """

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # NOTE: unknown names are a ValueError naming them (the generated __init__ would raise a TypeError).
        unknown = sorted(set(kwargs) - set(_INIT_FIELDS))
        if unknown:
            raise ValueError(f"unknown ContinuousBatchingConfig field(s): {', '.join(unknown)}")
        super().__init__(*args, **kwargs)
        self.memory_percent_set = "max_memory_percent" in kwargs or len(args) > _MEMORY_PERCENT_POSITION

    def replace(self, **changes: Any) -> ContinuousBatchingConfig:
        """A validated copy with some fields changed.

        A new `scheduler_type` without a `safety_margin` re-derives the margin from the new scheduler; a
        `max_memory_percent` never given stays not given (`memory_percent_set` carries over)."""
        fields = {name: getattr(self, name) for name in _INIT_FIELDS}
        if "scheduler_type" in changes and "safety_margin" not in changes:
            fields["safety_margin"] = None
        if not self.memory_percent_set:
            del fields["max_memory_percent"]
        fields.update(changes)
        return ContinuousBatchingConfig(**fields)

    def log_unavailable_features(self, has_cuda: bool) -> None:
        """Warn, once per process, about compatibility fields set here that cannot take effect
        (`rollout.compat_config.log_unavailable_features`)."""
        compat_config.log_unavailable_features(self, has_cuda)
