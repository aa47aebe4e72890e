"""`rollout serve` with vLLM's sampling fields (issue 32): `repetition_penalty` and `min_tokens` equal to
transformers' generate, `logit_bias` forcing a token, out-of-range values and unimplemented fields a 400
naming the field."""

from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
from support.sampling import hf_generate, repeating_prompt  # noqa: E402
from support.serving import save_tiny, serving  # noqa: E402
from support.tiny_models import make_model  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model")) as s:
        yield s


def complete(server, **body):
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {server.key}"}, timeout=120,
                   json={"model": "tiny", "return_token_ids": True, **body})
    return r


def test_repetition_penalty_and_min_tokens_equal_hf(server):
    model = make_model("qwen3", seed=0)
    prompt = repeating_prompt(model)
    plain = dict(do_sample=False, max_new_tokens=8, pad_token_id=0)
    r = complete(server, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.5)
    got = r.json()["choices"][0]["token_ids"]
    assert got == hf_generate(model, prompt, GenerationConfig(**plain, eos_token_id=None, repetition_penalty=1.5))
    assert got != hf_generate(model, prompt, GenerationConfig(**plain, eos_token_id=None))
    stop = got[1]
    eos = sorted(server.engine.manager.core.eos_ids | {stop})
    early = complete(server, prompt=prompt, max_tokens=8, temperature=0, repetition_penalty=1.5,
                     stop_token_ids=[stop]).json()["choices"][0]["token_ids"]
    assert early == got[:2]
    late = complete(server, prompt=prompt, max_tokens=8, temperature=0, repetition_penalty=1.5, stop_token_ids=[stop],
                    min_tokens=5).json()["choices"][0]["token_ids"]
    want = hf_generate(model, prompt, GenerationConfig(**plain, eos_token_id=eos, repetition_penalty=1.5,
                                                       min_new_tokens=5))
    assert late == want and len(late) >= 5


def test_logit_bias_forces_a_token(server):
    r = complete(server, prompt=[5, 6, 7], max_tokens=6, temperature=1.0, seed=1, ignore_eos=True,
                 logit_bias={"42": 100})
    assert r.json()["choices"][0]["token_ids"] == [42] * 6


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 0), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("min_p", 1.5),
    ("min_tokens", 99), ("logit_bias", {"100000": 1.0}), ("use_beam_search", True), ("best_of", 2),
    ("num_beams", 2), ("guided_json", {"type": "object"}),
])
def test_bad_or_unimplemented_fields_are_400_naming_them(server, field, value):
    r = complete(server, prompt=[5, 6, 7], max_tokens=4, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
