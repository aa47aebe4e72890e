"""One rollout contract (issue 56): the public `SamplingParams`, the `Rollout` protocol the four backends share,
the one weight door, and nothing outside `rollout/engine/` reaching into the engine core."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch
from support.tiny_models import make_model
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, Rollout, RolloutEngine, SamplingParams
from rollout.client import RolloutClient
from rollout.contract import GENERATE_PARAMETERS, SCORE_PARAMETERS, UPDATE_PARAMETERS
from rollout.fleet.pool import RolloutPool
from rollout.fleet.ray_fleet import RolloutFleet

ROOT = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = (RolloutEngine, RolloutPool, RolloutFleet, RolloutClient)
SMALL = dict(page_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def engine():
    model = make_model("qwen3", seed=0)
    gc = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=12)
    with RolloutEngine(model, config=ContinuousBatchingConfig(**SMALL), generation_config=gc) as e:
        yield e


def test_the_names_are_public_and_the_engine_is_a_rollout(engine):
    import rollout

    assert rollout.SamplingParams is SamplingParams and rollout.Rollout is Rollout
    assert isinstance(engine, Rollout)
    assert not isinstance(object(), Rollout)


def _names(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_the_four_backends_share_the_protocols_parameter_names(cls):
    for method, expected in (("generate", GENERATE_PARAMETERS), ("score", SCORE_PARAMETERS),
                             ("update_weights", UPDATE_PARAMETERS)):
        names = _names(getattr(cls, method))
        assert [n for n in names if n in expected] == list(expected), (cls.__name__, method, names)
        # NOTE: the protocol's shared prefix is positional in the same order everywhere
        positional = [n for n, p in inspect.signature(getattr(cls, method)).parameters.items()
                      if p.kind is p.POSITIONAL_OR_KEYWORD and n != "self"]
        shared = [n for n in expected if n in positional]
        assert positional[: len(shared)] == shared, (cls.__name__, method, positional)
    assert callable(cls.close) and hasattr(cls, "policy_version") or "policy_version" in _init_attrs(cls)


def _init_attrs(cls) -> set[str]:
    tree = ast.parse(inspect.getsource(cls))
    return {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
            if isinstance(t, ast.Attribute)}


def test_generate_at_most_fourteen_parameters():
    assert len(_names(RolloutEngine.generate)) <= 14, _names(RolloutEngine.generate)


def test_sampling_params_is_token_and_logprob_identical_to_the_keyword_form(engine):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    kw = engine.generate(prompts, temps=[0.7, 1.0], group_size=3, max_new_tokens=10, top_k=20, top_p=0.9, seed=4)
    sp = SamplingParams(top_k=20, top_p=0.9, seed=4, max_tokens=10)
    one = engine.generate(prompts, temps=[0.7, 1.0], group_size=3, sampling=sp)
    each = engine.generate(prompts, group_size=3, sampling=[sp.with_fields(temperature=0.7),
                                                            sp.with_fields(temperature=1.0)])
    for other in (one, each):
        assert torch.equal(kw.completion_ids, other.completion_ids)
        assert torch.equal(kw.logprobs, other.logprobs)
        assert torch.equal(kw.temperatures, other.temperatures)
    greedy_kw = engine.generate(prompts, temps=0.0, max_new_tokens=8)
    greedy_sp = engine.generate(prompts, sampling=SamplingParams(temperature=0.0, max_tokens=8))
    assert torch.equal(greedy_kw.completion_ids, greedy_sp.completion_ids)


def test_processors_and_top_logprobs_ride_in_sampling_params(engine):
    prompts = [[5, 6, 7, 8]]
    plain = engine.generate(prompts, sampling=SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))
    assert plain.top_logprobs.shape == (1, 6, 3)
    first = int(plain.completion_ids[0, 0])
    banned = engine.generate(prompts, sampling=SamplingParams(temperature=0.0, max_tokens=6,
                                                              logit_bias={first: -100.0}))
    assert int(banned.completion_ids[0, 0]) != first
    stopped = engine.generate(prompts, sampling=SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first]))
    assert stopped.completion_mask.sum() == 1 and stopped.finish_reasons[0] == "stop"


def test_a_field_set_twice_or_invalid_is_refused_by_name(engine):
    with pytest.raises(ValueError, match="temps= and sampling.temperature"):
        engine.generate([[5, 6]], temps=0.5, sampling=SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="max_new_tokens= and sampling.max_tokens"):
        engine.generate([[5, 6]], max_new_tokens=3, sampling=SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="sampling has 1 SamplingParams for 2 prompts"):
        engine.generate([[5, 6], [7, 8]], sampling=[SamplingParams()])
    for bad, field in (
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="logit_bias must hold token ids in"):
        engine.generate([[5, 6]], sampling=SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="unknown sampling field 'top_q'"):
        SamplingParams.from_fields({"top_q": 0.5})


def test_sampling_params_records_what_was_set_and_keeps_vllm_spellings():
    sp = SamplingParams(temperature=0.5, top_k=0, logit_bias={"3": 1.0}, stop_token_ids=[2])
    assert sp.given == {"temperature", "top_k", "logit_bias", "stop_token_ids"}
    assert sp.top_k == 0 and sp.logit_bias == ((3, 1.0),) and sp.stop_token_ids == (2,) and sp.top_p == 1.0
    assert SamplingParams.from_fields({"min_new_tokens": 2, "max_new_tokens": 5}) == SamplingParams(min_tokens=2,
                                                                                                   max_tokens=5)
    import pickle

    assert pickle.loads(pickle.dumps(sp)).given == sp.given  # NOTE: fleets send it to Ray actors


def test_score_takes_sampling_params_like_generate(engine):
    batch = engine.generate([[5, 6, 7]], temps=0.8, group_size=2, max_new_tokens=6, seed=1)
    by_batch = engine.score(batch)
    prompts, completions = batch.rows()
    by_sampling = engine.score(prompts, completions, sampling=SamplingParams(temperature=0.8))
    torch.testing.assert_close(by_batch.logprobs, by_sampling.logprobs, rtol=0, atol=0)


def test_one_weight_door_takes_a_directory_and_a_version(engine, tmp_path):
    other = make_model("qwen3", seed=1)
    other.save_pretrained(tmp_path / "m")
    before = engine.policy_version
    assert engine.update_weights(str(tmp_path / "m")) == before + 1
    assert engine.update_weights(other, version=before + 10) == before + 10 == engine.policy_version
    with pytest.raises(FileNotFoundError, match="not a directory"):
        engine.update_weights(str(tmp_path / "missing"))


def _outside_engine() -> list[pathlib.Path]:
    return [
        p for p in sorted((ROOT / "rollout").rglob("*.py")) if "engine" not in p.relative_to(ROOT / "rollout").parts[:1]
    ]


def core_reaches(source: str) -> list[int]:
    """Lines of `source` that reach an engine core: an attribute named `core` (`manager.core`, `x.core.y`)."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and n.attr == "core"]


def test_nothing_outside_rollout_engine_reaches_the_core():
    found = {str(p.relative_to(ROOT)): core_reaches(p.read_text()) for p in _outside_engine()}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_core_reach_check_sees_attribute_chains():
    assert core_reaches("x = self.engine.manager.core.policy_version") == [1]
    assert core_reaches("core = manager.core\ny = 1") == [1]
    assert core_reaches("from prometheus_client.core import X\nx = m.cores") == []


def test_docs_sampling_table_is_the_field_list():
    from rollout.sampling_params import FIELDS

    text = (ROOT / "docs" / "sampling.md").read_text()
    rows = [line.split("|")[1].strip().strip("`") for line in text.splitlines()
            if line.startswith("| `") and line.count("|") == 4]
    assert rows == list(FIELDS), "docs/sampling.md's SamplingParams table differs from rollout.sampling_params.FIELDS"


def test_the_servers_place_every_sampling_field():
    """The one field list reaches the OpenAI wire: each `SamplingParams` field is on `SamplingRequest` under its
    name, under vLLM's other name, or declared off the wire; a new field fails this until it is placed."""
    pytest.importorskip("fastapi")
    from rollout.sampling_params import FIELDS
    from rollout.serve import bridge
    from rollout.serve.protocol import CompletionRequest

    placed = [*bridge.WIRE_FIELDS, *bridge.WIRE_RENAMED, *bridge.NOT_ON_THE_WIRE]
    assert sorted(placed) == sorted(FIELDS), set(placed) ^ set(FIELDS)
    assert set(bridge.WIRE_FIELDS) <= set(CompletionRequest.model_fields)
    source = inspect.getsource(bridge.EngineBridge.sampling)
    missing = [f for f in bridge.WIRE_FIELDS if f"{f}=" not in source and f != "prompt_logprobs"]
    assert missing == [], f"EngineBridge.sampling does not pass {missing}"
