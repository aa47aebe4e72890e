"""Issue 39 through `rollout serve` (processed logprobs, the default): under each logits processor alone and all
together, greedy and sampled, a generated token's logprob equals its entry in its own top-N (`/v1/completions`
`logprobs=N` with `echo`, chat `top_logprobs`), and `RolloutEngine.score` on the server's engine with the same
sampling fields gives the same logprobs for the generated tokens, the echoed prompt and the top N."""

from __future__ import annotations

import math

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
from support.sampling import sampling_of  # noqa: E402
from support.serving import make_tokenizer, save_tiny, serving  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ATOL = 1e-4  # NOTE: decode vs prefill forwards of the same tokens differ by summation order only
N = 5
FLOOR = -9999.0  # the server's stand-in for -inf
PROMPT = "abcabcabc the cat sat on the mat abc"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model"), max_batch_tokens=32) as s:
        yield s


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def cases(tok) -> dict[str, tuple[dict, dict]]:
    """name -> (the request's vLLM fields, `score`'s keywords for the same processors)."""
    a, b, c = tok.convert_tokens_to_ids(["a", "b", "c"])
    every = dict(repetition_penalty=1.4, presence_penalty=0.8, frequency_penalty=0.4, logit_bias={str(a): 2.0},
                 min_p=0.02, min_tokens=6, stop_token_ids=[c], bad_words=["bc"], top_k=50, top_p=0.95)
    every_kw = dict(repetition_penalty=1.4, presence_penalty=0.8, frequency_penalty=0.4, logit_bias={a: 2.0},
                    min_p=0.02, min_tokens=6, stop_token_ids=[c], bad_words_ids=[[b, c]], top_k=50, top_p=0.95)
    return {
        "repetition_penalty": ({"repetition_penalty": 1.6}, {"repetition_penalty": 1.6}),
        "presence_penalty": ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
        "frequency_penalty": ({"frequency_penalty": 1.0}, {"frequency_penalty": 1.0}),
        "logit_bias": ({"logit_bias": {str(a): 3.0, str(b): -2.0}}, {"logit_bias": {a: 3.0, b: -2.0}}),
        "min_p": ({"min_p": 0.05}, {"min_p": 0.05}),
        "min_tokens": ({"min_tokens": 10, "stop_token_ids": [a, c]}, {"min_tokens": 10, "stop_token_ids": [a, c]}),
        "bad_words": ({"bad_words": ["a", "bc"]}, {"bad_words_ids": [[a], [b, c]]}),
        "every": (every, every_kw),
    }


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {server.key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def clamp(values) -> list[float]:
    return [max(float(v), FLOOR) for v in values]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("case", ["repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                                  "min_p", "min_tokens", "bad_words", "every"])
def test_completions_logprobs_agree_with_top_and_score(server, tok, case, temperature):
    fields, kw = cases(tok)[case]
    prompt = tok(PROMPT)["input_ids"]
    body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": temperature,
                                            "seed": 5, "echo": True, "logprobs": N, "return_token_ids": True,
                                            **fields})
    choice = body["choices"][0]
    lp, gen = choice["logprobs"], choice["token_ids"]
    assert len(lp["token_logprobs"]) == len(prompt) + len(gen) and gen
    hits = 0
    for value, top, string in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], lp["tokens"][1:], strict=True):
        if len(top) == N:  # NOTE: the chosen token is one of the top N (else the server adds it)
            hits += 1
            assert top[string] == value
    assert hits >= 5, f"only {hits} positions with the chosen token in its top {N}"

    scored = server.engine.score([prompt], [gen], temps=temperature, top_logprobs=N, prompt_logprobs=True,
                                 sampling=sampling_of(kw))
    got_gen = lp["token_logprobs"][len(prompt):]
    assert got_gen == pytest.approx(clamp(scored.logprobs[0, : len(gen)]), abs=ATOL)
    got_prompt = lp["token_logprobs"][1 : len(prompt)]
    assert got_prompt == pytest.approx(clamp(scored.prompt_logprobs[0, 1:]), abs=ATOL)
    for j, top in enumerate(lp["top_logprobs"][len(prompt):]):
        if len(top) == N:
            assert sorted(top.values(), reverse=True) == pytest.approx(clamp(scored.top_logprobs[0, j]), abs=ATOL)
    if temperature > 0:  # NOTE: the case moves the logprobs (greedy rows report raw ones by design)
        plain = server.engine.score([prompt], [gen], temps=temperature,
                                    sampling=sampling_of({k: v for k, v in kw.items() if k in ("top_k", "top_p")}))
        diff = (plain.logprobs[0, : len(gen)] - scored.logprobs[0, : len(gen)]).abs().max()
        assert diff > 1e-2, f"{case} changes no generated logprob"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("case", ["repetition_penalty", "logit_bias", "min_tokens", "every"])
def test_chat_logprobs_agree_with_top_and_score(server, tok, case, temperature):
    fields, kw = cases(tok)[case]
    body = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10, "temperature": temperature, "seed": 9,
        "logprobs": True, "top_logprobs": N, "return_token_ids": True, **fields})
    content, gen = body["choices"][0]["logprobs"]["content"], body["choices"][0]["token_ids"]
    assert len(content) == len(gen) > 0
    scored = server.engine.score([body["prompt_token_ids"]], [gen], temps=temperature, top_logprobs=N,
                                 sampling=sampling_of(kw))
    assert [c["logprob"] for c in content] == pytest.approx(clamp(scored.logprobs[0, : len(gen)]), abs=ATOL)
    hits = 0
    for j, item in enumerate(content):
        tops = item["top_logprobs"]
        assert [t["logprob"] for t in tops] == pytest.approx(clamp(scored.top_logprobs[0, j]), abs=ATOL)
        same = [t["logprob"] for t in tops if t["token"] == item["token"]]
        if same:
            hits += 1
            assert same[0] == item["logprob"]
    assert hits >= 3 and all(math.isfinite(c["logprob"]) for c in content)
