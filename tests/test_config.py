"""`ContinuousBatchingConfig`: the documented defaults, and a ValueError naming the field for every bad value."""

from __future__ import annotations

import math

import pytest

from rollout import ContinuousBatchingConfig

DEFAULTS = dict(
    page_size=256,
    num_blocks=None,
    max_memory_percent=0.8,
    max_batch_tokens=None,
    max_requests_per_batch=None,
    scheduler_type="fifo",
    safety_margin=0.15,  # resolved from the fifo scheduler
    return_logprobs=False,
    logprobs_mode="processed",
    allow_block_sharing=True,
    per_request_processors=True,
    cpu_offload_space=0.0,
    cpu_offload_space_safety_threshold=0.8,
    use_cuda_graph=False,
    use_async_batching=False,
    default_compile_level=0,
    max_blocks_per_request=None,
    auto_switch_to_flash=True,
)
# accepted for compatibility with transformers; DESIGN.md gives no default
OTHER_FIELDS = (
    "q_padding_interval_size",
    "kv_padding_interval_size",
    "varlen_compile_config",
    "decode_compile_config",
    "cpu_group_timeout",
)


def test_defaults():
    cfg = ContinuousBatchingConfig()
    for name, value in DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    for name in OTHER_FIELDS:
        assert hasattr(cfg, name)


def test_safety_margin_default_follows_the_scheduler():
    assert ContinuousBatchingConfig(scheduler_type="prefill_first").safety_margin == 0.0
    assert ContinuousBatchingConfig(scheduler_type="fifo").safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler_type="prefill_first", safety_margin=0.3).safety_margin == 0.3
    assert ContinuousBatchingConfig(safety_margin=0.0).safety_margin == 0.0


BAD = [
    ("page_size", 3),
    ("page_size", 0),
    ("page_size", -16),
    ("page_size", 16.0),
    ("page_size", "16"),
    ("page_size", True),
    ("num_blocks", 0),
    ("num_blocks", -1),
    ("num_blocks", 2.5),
    ("max_memory_percent", 0.0),
    ("max_memory_percent", 1.5),
    ("max_memory_percent", -0.1),
    ("max_memory_percent", math.nan),
    ("max_batch_tokens", 0),
    ("max_batch_tokens", -256),
    ("max_requests_per_batch", 0),
    ("scheduler_type", "lifo"),
    ("scheduler_type", "FIFO"),
    ("scheduler_type", None),
    ("safety_margin", -0.01),
    ("safety_margin", 1.0),
    ("safety_margin", 1.5),
    ("safety_margin", math.nan),
    ("safety_margin", "0.1"),
    ("logprobs_mode", "logits"),
    ("logprobs_mode", None),
    ("return_logprobs", "yes"),
    ("allow_block_sharing", 1),
    ("per_request_processors", None),
    ("cpu_offload_space", -1.0),
    ("cpu_offload_space_safety_threshold", 0.0),
    ("cpu_offload_space_safety_threshold", 1.5),
    ("default_compile_level", -1),
    ("default_compile_level", 4),
    ("default_compile_level", 1.5),
    ("max_blocks_per_request", -1),
    ("cpu_group_timeout", 0),
    ("q_padding_interval_size", 0),
    ("kv_padding_interval_size", 0),
]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_value_raises_value_error_naming_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        ContinuousBatchingConfig(**{name: value})


def test_unknown_field_raises_value_error_naming_it():
    with pytest.raises(ValueError, match="page_sise"):
        ContinuousBatchingConfig(page_sise=16)


GOOD = [
    ("page_size", 4),
    ("num_blocks", 1),
    ("max_memory_percent", 1.0),
    ("max_batch_tokens", 1),
    ("max_requests_per_batch", 1),
    ("scheduler_type", "prefill_first"),
    ("safety_margin", 0.0),
    ("safety_margin", 0.99),
    ("logprobs_mode", "raw"),
    ("return_logprobs", True),
    ("cpu_offload_space", 0.5),
    ("cpu_offload_space", None),
    ("max_blocks_per_request", 0),
]


@pytest.mark.parametrize("name, value", GOOD, ids=[f"{n}={v!r}" for n, v in GOOD])
def test_boundary_values_are_accepted(name, value):
    assert getattr(ContinuousBatchingConfig(**{name: value}), name) == value


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_every_compile_level_is_accepted(level):
    assert ContinuousBatchingConfig(default_compile_level=level).default_compile_level == level
