"""In-flight weight updates (issue 28): `update_weights(in_flight="keep")` on a live engine.

A `generate` runs on another thread; the update lands between two of its steps. Each request then holds
tokens of two versions (`RolloutBatch.versions` shows the switch), the tokens before the switch are the old
model's greedy ones, and the tokens after it are what the new weights produce from that context:
- KV kept (default): the new model continuing on the old model's KV of the context (an HF oracle:
  `past_key_values` computed under the old weights, then greedy decoding under the new ones);
- `recompute_kv=True`: HF greedy of the new model on the whole context.
No request reads another's KV of the old version afterwards (the prefix cache is cold for new requests).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from support.tiny_models import hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine

pytestmark = pytest.mark.timeout(120)

MAX_NEW = 96


@pytest.fixture(scope="module")
def models():
    return make_model("qwen3", seed=0), make_model("qwen3", seed=1)


def make_engine(model) -> RolloutEngine:
    gc = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=MAX_NEW)
    return RolloutEngine(model, config=ContinuousBatchingConfig(page_size=16, num_blocks=256), generation_config=gc)


@torch.no_grad()
def kept_kv_oracle(old, new, prompt: list[int], generated: list[int], k: int, n: int) -> list[int]:
    """Greedy tokens k+1.. when the first k were sampled under `old`: the KV of prompt + generated[:k-1]
    is `old`'s (computed before the update); generated[k-1] and everything after run under `new`."""
    past = old(torch.tensor([prompt + generated[: k - 1]]), use_cache=True).past_key_values
    token, out = generated[k - 1], []
    for _ in range(n):
        step = new(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, token = step.past_key_values, int(step.logits[0, -1].argmax())
        out.append(token)
    return out


def generate_in_background(engine, prompts, **kwargs):
    result: dict = {}

    def work():
        try:
            result["batch"] = engine.generate(prompts, **kwargs)
        except Exception as e:  # pragma: no cover - reported by the test
            result["error"] = e

    start = engine.cache_stats()["generated_tokens"]
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while engine.cache_stats()["generated_tokens"] < start + 4 * len(prompts):
        assert worker.is_alive() and time.monotonic() < deadline, "generate ended before the update"
        time.sleep(0.0005)
    return worker, result


@pytest.mark.parametrize("recompute_kv", [False, True], ids=["kv_kept", "kv_recomputed"])
def test_inflight_update_switches_versions_mid_request(models, recompute_kv):
    old, new = models
    prompts = random_prompts(3, 20, 40, seed=3)  # longer than a page: the prefix cache matters
    with make_engine(copy.deepcopy(old)) as engine:
        v0 = engine.policy_version
        worker, result = generate_in_background(engine, prompts, temps=0.0, max_new_tokens=MAX_NEW)
        v1 = engine.update_weights(new.state_dict(), in_flight="keep", recompute_kv=recompute_kv)
        worker.join(60)
        assert not worker.is_alive() and "error" not in result, result.get("error")
        batch = result["batch"]
        assert batch.versions.dtype == torch.int64 and batch.versions.shape == batch.completion_ids.shape
        assert batch.finish_reasons == ["length"] * 3  # nothing aborted
        for row, prompt in enumerate(prompts):
            gen = batch.completion_ids[row].tolist()
            versions = batch.versions[row].tolist()
            k = versions.count(v0)
            assert 1 <= k < MAX_NEW, f"row {row}: the update did not land mid-request ({versions})"
            assert versions == [v0] * k + [v1] * (MAX_NEW - k)  # one switch, at token k
            assert gen[:k] == hf_greedy(old, prompt, k)
            if recompute_kv:
                want = hf_greedy(new, prompt + gen[:k], MAX_NEW - k)
            else:
                want = kept_kv_oracle(old, new, prompt, gen, k, MAX_NEW - k)
                # the oracle tells the two semantics apart on this context
                assert want != hf_greedy(new, prompt + gen[:k], MAX_NEW - k)
            assert gen[k:] == want, f"row {row}: switch at token {k}"
        if recompute_kv:
            assert engine.cache_stats()["recomputed_tokens"] > 0
        # requests after the update read no old-version KV: with KV kept, the in-flight requests' pages
        # never reach the prefix cache (cold for these prompts); recomputed pages are new-version KV
        cached = engine.cache_stats()["cached_prompt_tokens"]
        after = engine.generate(prompts, temps=0.0, max_new_tokens=8)
        assert (engine.cache_stats()["cached_prompt_tokens"] > cached) == recompute_kv
        assert after.versions.eq(v1).all()
        assert [r.tolist() for r in after.completion_ids] == [hf_greedy(new, p, 8) for p in prompts]
        assert engine.cache_stats()["free_blocks"] == engine.cache_stats()["num_blocks"]


def test_recompute_kv_needs_keep(models):
    with make_engine(copy.deepcopy(models[0])) as engine:
        with pytest.raises(ValueError, match="recompute_kv"):
            engine.update_weights(models[1].state_dict(), recompute_kv=True)
        assert engine.policy_version == 0


def test_versions_of_a_plain_generate_are_the_engine_version(models):
    with make_engine(copy.deepcopy(models[0])) as engine:
        engine.update_weights(models[1].state_dict())
        batch = engine.generate(random_prompts(2, 5, 9, seed=4), temps=1.0, group_size=2, max_new_tokens=6, seed=1)
        mask = batch.completion_mask.bool()
        assert batch.versions[mask].eq(1).all() and batch.versions[~mask].eq(0).all()
