"""`rollout serve` scoring fields in vLLM's shapes: `/v1/completions` `echo` (with `max_tokens: 0`),
`logprobs=N` top dicts over prompt and generated positions, vLLM's `prompt_logprobs`, chat `top_logprobs`,
and the OpenAPI schema at `/openapi.json` behind the key. Values against a teacher-forced forward."""

from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
from support.serving import make_tokenizer, save_tiny, serving  # noqa: E402
from support.tiny_models import make_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ATOL = 1e-4  # NOTE: JSON floats round-trip exactly; the margin covers the two forwards' summation orders


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model"), max_batch_tokens=32) as s:
        yield s


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def post(server, path, body, key="default"):
    headers = {"Authorization": f"Bearer {server.key if key == 'default' else key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def log_dist(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] raw log-distribution after each position."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_scores_the_prompt_with_max_tokens_0(server, model, tok):
    """lm-eval's loglikelihood request, without the generated token: the prompt's tokens, `null` first,
    then each token's logprob and a top-2 dict that holds the chosen token; text is the prompt."""
    prompt = tok("The cat sat on the mat and looked around.")["input_ids"]
    r = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == tok.decode(prompt) and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    dist = log_dist(model, prompt)
    ref = dist[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), ref, atol=ATOL, rtol=0)
    for j, top in enumerate(lp["top_logprobs"][1:]):
        best = dist[j].topk(2)
        assert 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(best.values[0].item(), abs=ATOL)
        assert top[lp["tokens"][j + 1]] == lp["token_logprobs"][j + 1]
    assert lp["text_offset"] == [len(tok.decode(prompt[:j])) for j in range(len(prompt))]


def test_echo_with_logprobs_0_gives_each_tokens_own_logprob(server, model, tok):
    """`logprobs: 0` with echo (the sampled / given token's logprob only): each top dict holds the token alone
    (it was a 500: the engine computes no top-k for k=0)."""
    prompt = tok("The cat sat.")["input_ids"]
    r = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 1,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["top_logprobs"][0] is None
    tops = zip(lp["top_logprobs"][1:], lp["tokens"][1:], strict=True)
    assert all(list(top) == [token] for top, token in tops)
    dist = log_dist(model, prompt)
    ref = dist[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:len(prompt)]), ref, atol=ATOL, rtol=0)


def test_echo_with_one_generated_token_as_lm_eval_sends_it(server, model):
    """`echo, logprobs: 1, max_tokens: 1, temperature: 0` on token ids, two prompts in one request:
    prompt positions then the greedy token, whose top-1 is itself (lm-eval's is_greedy check)."""
    prompts = [[5, 17, 33, 48, 60, 71], [9, 9, 12, 100, 3]]
    r = post(server, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                         "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    for choice, prompt in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1
        dist = log_dist(model, prompt)
        greedy = int(dist[-1].argmax())
        assert lp["token_logprobs"][-1] == pytest.approx(dist[-1, greedy].item(), abs=ATOL)
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
        ref = dist[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:-1]), ref, atol=ATOL, rtol=0)


def test_vllm_prompt_logprobs_shape_and_values(server, model):
    prompt = [4, 50, 51, 52, 90, 7, 7, 30]
    r = post(server, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 3, "max_tokens": 2,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    dist = log_dist(model, prompt)
    for j, entry in enumerate(plp[1:]):
        tok = prompt[j + 1]
        assert 3 <= len(entry) <= 4 and str(tok) in entry
        assert entry[str(tok)]["logprob"] == pytest.approx(dist[j, tok].item(), abs=ATOL)
        assert entry[str(tok)]["rank"] == int((dist[j] > dist[j, tok]).sum()) + 1
        best = [e for e in entry.values() if e["rank"] == 1]
        assert best and best[0]["logprob"] == pytest.approx(dist[j].max().item(), abs=ATOL)


def test_chat_top_logprobs(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi there"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == item.logprob
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.top_logprobs[2].logprob


def test_completion_top_logprobs_while_sampling_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=60)
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=1.0, logprobs=5, seed=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 4
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == value and 5 <= len(top) <= 6


def test_openapi_schema_behind_the_key(server):
    assert httpx.get(server.url + "/openapi.json", timeout=30).status_code == 401
    r = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {server.key}"}, timeout=30)
    assert r.status_code == 200
    schema = r.json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"echo", "logprobs", "prompt_logprobs"} <= set(props)
