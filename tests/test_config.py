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


# ------------------------------------------------------------------ structure (issue #24)
def test_init_is_defined_in_the_class_body_not_patched_in():
    import ast
    import inspect

    from rollout import config

    assert "__init__" in ContinuousBatchingConfig.__dict__
    assert ContinuousBatchingConfig.__init__.__qualname__ == "ContinuousBatchingConfig.__init__"
    tree = ast.parse(inspect.getsource(config))
    patched = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Attribute) and t.attr == "__init__" for t in node.targets)]
    assert not patched


def test_unknown_field_is_a_value_error_not_a_type_error():
    with pytest.raises(ValueError, match="unknown ContinuousBatchingConfig field.*: bogus"):
        ContinuousBatchingConfig(16, bogus=1)


def test_positional_construction_and_memory_percent_set():
    cfg = ContinuousBatchingConfig(16, 8)
    assert (cfg.page_size, cfg.num_blocks, cfg.max_memory_percent, cfg.memory_percent_set) == (16, 8, 0.8, False)
    cfg = ContinuousBatchingConfig(16, 8, 0.8)
    assert cfg.memory_percent_set and cfg == ContinuousBatchingConfig(page_size=16, num_blocks=8)
    with pytest.raises(ValueError, match="max_memory_percent"):
        ContinuousBatchingConfig(16, 8, 2.0)


def test_replace_re_derives_the_safety_margin_only_when_not_given():
    cfg = ContinuousBatchingConfig(safety_margin=0.3)
    assert cfg.replace(page_size=16).safety_margin == 0.3
    assert cfg.replace(scheduler_type="prefill_first").safety_margin == 0.0
    assert cfg.replace(scheduler_type="prefill_first", safety_margin=0.2).safety_margin == 0.2
    with pytest.raises(ValueError, match="page_size"):
        cfg.replace(page_size=2)


def test_the_config_holds_no_logging_state():
    import dataclasses

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert names == {f.name for f in dataclasses.fields(ContinuousBatchingConfig) if f.init} | {"memory_percent_set"}
    with pytest.raises(AttributeError):
        ContinuousBatchingConfig().anything = 1  # slots: nothing can be stashed on it


def test_attn_backend_docstring_says_auto_picks_flex_on_cuda_and_flash_is_refused():
    doc = " ".join(ContinuousBatchingConfig.__doc__.split())
    assert '"flex" on CUDA' in doc and "not implemented yet" in doc


# one non-default value each; use_async_batching needs use_cuda_graph=True, as in transformers
COMPAT_VALUES = dict(
    use_cuda_graph=True,
    q_padding_interval_size=32,
    kv_padding_interval_size=1024,
    use_async_batching=True,
    varlen_compile_config=object(),
    decode_compile_config=object(),
    max_blocks_per_request=32,
    auto_switch_to_flash=False,
)


def test_compat_fields_are_the_documented_ones():
    from rollout.compat_config import COMPAT_FIELDS
    from rollout.config import COMPAT_FIELD_NAMES

    assert set(COMPAT_FIELD_NAMES) == set(COMPAT_FIELDS) == set(COMPAT_VALUES)


@pytest.mark.parametrize("name", list(COMPAT_VALUES))
def test_compat_field_is_accepted_and_documented(name):
    from rollout.compat_config import COMPAT_FIELDS

    extra = {"use_cuda_graph": True} if name == "use_async_batching" else {}
    cfg = ContinuousBatchingConfig(**{name: COMPAT_VALUES[name]}, **extra)
    assert getattr(cfg, name) is COMPAT_VALUES[name] or getattr(cfg, name) == COMPAT_VALUES[name]
    doc = COMPAT_FIELDS[name]
    assert doc.transformers and doc.here
    assert name in " ".join(ContinuousBatchingConfig.__doc__.split())


def test_use_async_batching_requires_use_cuda_graph():
    with pytest.raises(ValueError, match="use_async_batching"):
        ContinuousBatchingConfig(use_async_batching=True)


def test_unavailable_features_are_logged_once_per_process(monkeypatch, caplog):
    import logging

    from rollout import compat_config

    monkeypatch.setattr(compat_config, "LOGGED", set())
    gpu_only = dict(use_cuda_graph=True, use_async_batching=True)
    with caplog.at_level(logging.WARNING, logger="rollout"):
        ContinuousBatchingConfig().log_unavailable_features(False)
        ContinuousBatchingConfig(**gpu_only).log_unavailable_features(True)
        assert not caplog.records
        for _ in range(2):
            ContinuousBatchingConfig(**gpu_only).log_unavailable_features(False)
            ContinuousBatchingConfig(decode_compile_config=object()).log_unavailable_features(True)
    messages = [r.getMessage() for r in caplog.records]
    # NOTE: the compile configs have their meaning (rollout.model.static_decode): nothing to warn about
    assert messages == ["use_cuda_graph, use_async_batching need CUDA and have no effect on this CPU-only machine"]
