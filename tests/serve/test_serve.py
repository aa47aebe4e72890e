"""`rollout serve` over HTTP, driven by the real `openai` client and `httpx`: one server for the module on
127.0.0.1 (a tiny saved model whose tokenizer has a chat template), stopped at the end."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
from support.serving import make_tokenizer, save_tiny, serving  # noqa: E402
from support.tiny_models import hf_greedy, make_model, random_prompts, teacher_forced_logprobs  # noqa: E402

NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model"), num_blocks=NUM_BLOCKS) as s:
        yield s


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=60)


def post(server, path, body=None, key="default", **kw):
    headers = {"Authorization": f"Bearer {server.key if key == 'default' else key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {server.key}"}).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


# ------------------------------------------------------------------------------------ 1. generation
def test_completions_token_ids_in_and_out_greedy_equals_generate(server, client, model, tok):
    prompts = random_prompts(3, 5, 30, seed=1)
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(prompts, r.choices, strict=True):
        d = c.model_dump()
        assert d["prompt_token_ids"] == p
        assert d["token_ids"] == hf_greedy(model, p, 12)
        assert c.text == tok.decode(d["token_ids"], skip_special_tokens=True)
        assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 36
    text = client.completions.create(model="tiny", prompt="The cat sat", max_tokens=5, **GREEDY)
    ids = tok("The cat sat")["input_ids"]
    assert text.choices[0].model_dump()["prompt_token_ids"] == ids
    assert text.choices[0].model_dump()["token_ids"] == hf_greedy(model, ids, 5)


def test_chat_template_tools_kwargs_and_greedy(server, client, model, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, tools=tools,
                                       extra_body={"ignore_eos": True, "return_token_ids": True,
                                                   "chat_template_kwargs": {"greeting": "Hi!"}}, temperature=0)
    want = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, greeting="Hi!",
                                   tokenize=True)["input_ids"]
    body = r.model_dump()
    assert body["prompt_token_ids"] == list(want) and "calc" in tok.decode(want) and tok.decode(want).endswith("Hi!")
    assert body["choices"][0]["token_ids"] == hf_greedy(model, list(want), 10)
    assert r.choices[0].message.content == tok.decode(body["choices"][0]["token_ids"], skip_special_tokens=True)


def test_sampled_logprobs_match_teacher_forced_at_t1(server, client, model):
    prompt = random_prompts(1, 10, 10, seed=2)[0]
    r = client.completions.create(model="tiny", prompt=[prompt], max_tokens=16, temperature=1.0, n=3, seed=5,
                                  logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=8,
                                          temperature=1.0, seed=3, logprobs=True,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    cases = [(prompt, c.model_dump()["token_ids"], c.logprobs.token_logprobs) for c in r.choices]
    cases.append((chat.model_dump()["prompt_token_ids"], chat.model_dump()["choices"][0]["token_ids"],
                  [t.logprob for t in chat.choices[0].logprobs.content]))
    for p, toks, lps in cases:
        ref = teacher_forced_logprobs(model, p, toks)
        assert len(lps) == len(toks) == ref.numel()
        assert (torch.tensor(lps) - ref).abs().max().item() < 1e-4


def test_n_samples_are_prompt_major_and_seeded(server, client):
    prompts = random_prompts(2, 6, 9, seed=3)
    kw = dict(model="tiny", prompt=prompts, max_tokens=8, temperature=1.0, n=3, seed=11,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == list(range(6))
    for c in a.choices:
        assert c.model_dump()["prompt_token_ids"] == prompts[c.index // 3]
    ids = [c.model_dump()["token_ids"] for c in a.choices]
    assert ids == [c.model_dump()["token_ids"] for c in b.choices]  # same seed, same samples
    assert len({tuple(x) for x in ids[:3]}) > 1  # each sample draws its own stream


def test_streaming_text_equals_non_streamed(server, client):
    for stop in (None, "x"):
        kw = dict(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0, stop=stop,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        full = client.completions.create(**kw)
        chunks = list(client.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
        assert (
            sum((c.choices[0].model_dump()["token_ids"] for c in chunks), [])
            == full.choices[0].model_dump()["token_ids"]
        )
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    base = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, **GREEDY).choices[0].text
    stop = base[len(base) // 2]
    cut = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, stop=[stop], **GREEDY)
    assert cut.choices[0].text == base[: base.index(stop)] and cut.choices[0].finish_reason == "stop"
    msgs = [{"role": "user", "content": "tell me"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20


# ----------------------------------------------------------------------------- 2. security, bad input
def test_api_key_on_every_route_but_health_ping_version_metrics(server):
    for key in (None, "wrong"):
        for path in ("/v1/models", "/openapi.json", "/get_weight_version", "/is_paused"):
            r = httpx.get(server.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert post(server, "/v1/completions", {"prompt": "a"}, key=key).status_code == 401
        assert post(server, "/pause", key=key).status_code == 401
        assert post(server, "/tokenize", {"prompt": "a"}, key=key).status_code == 401
    for path in ("/health", "/ping", "/version", "/metrics"):  # NOTE: open, as vllm serve (metrics: a flag guards it)
        assert httpx.get(server.url + path).status_code == 200, path
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {server.key}"}).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"


BAD = [
    ("/v1/completions", {"model": "nope", "prompt": "a"}, "model"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "seed": "x"}, "seed"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "echo": True, "stream": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 128]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [5] * 30, "max_tokens": 1000}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [500]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "a"}]}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "temperature": float("nan")},
     "temperature"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.split('/')[-1]}-{f}" for p, _, f in BAD])
def test_bad_input_is_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, content=json.dumps(body, allow_nan=True),
                   headers={"Authorization": f"Bearer {server.key}", "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["code"] == 400


def test_malformed_json_body_limit_and_still_serving(server, client):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a",',
                   headers={"Authorization": f"Bearer {server.key}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = post(server, "/v1/completions", {"prompt": "a" * (1 << 17)})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    out = client.completions.create(model="tiny", prompt="still here", max_tokens=3, **GREEDY)
    assert len(out.choices[0].model_dump()["token_ids"]) == 3
    assert metric(server, "rollout_free_blocks") == NUM_BLOCKS


# ------------------------------------------------------------------------------ 3. load, disconnects
def test_64_concurrent_clients_complete(server, model):
    prompts = random_prompts(64, 4, 40, seed=4)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*[
                c.completions.create(model="tiny", prompt=[p], max_tokens=10, **GREEDY) for p in prompts])

    results = asyncio.run(main())
    got = [r.choices[0].model_dump()["token_ids"] for r in results]
    assert all(len(g) == 10 for g in got)
    for i in (0, 21, 63):
        assert got[i] == hf_greedy(model, prompts[i], 10)
    assert metric(server, "rollout_free_blocks") == NUM_BLOCKS


def test_client_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": [3] * 40, "max_tokens": 980, "temperature": 0, "ignore_eos": True, "stream": True}
    before = metric(server, "rollout_generated_tokens_total")
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {server.key}"}) as r:
        lines = r.iter_lines()
        seen = [line for line, _ in zip(lines, range(8), strict=False) if line.startswith("data:")]
        assert len(seen) >= 3
        assert metric(server, "rollout_free_blocks") < NUM_BLOCKS  # the stream holds its pages
    deadline = time.monotonic() + 20
    while metric(server, "rollout_free_blocks") < NUM_BLOCKS:
        assert time.monotonic() < deadline, "a disconnected stream kept its blocks"
        time.sleep(0.05)
    assert not server.engine.manager.core.requests
    assert metric(server, "rollout_generated_tokens_total") - before < 980  # cancelled, not run to the end


# ------------------------------------------------------------------------------------- multi-turn
def test_multi_turn_prefix_cache_grows_and_token_ids_exact(server, client, tok):
    """An agent loop on token ids: each turn's prompt is the previous trajectory (prompt + returned ids)
    plus the new user turn; the prefix cache serves ever more of it, no re-tokenisation needed."""
    trajectory: list[int] = []
    cached = []
    for turn in range(3):
        user = list(tok.apply_chat_template([{"role": "user", "content": f"turn {turn}: go on please"}],
                                            add_generation_prompt=True, tokenize=True)["input_ids"])
        prompt = trajectory + user
        r = client.completions.create(model="tiny", prompt=[prompt], max_tokens=24, **GREEDY).model_dump()
        choice = r["choices"][0]
        assert choice["prompt_token_ids"] == prompt
        assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        if turn:
            assert cached[-1] >= (len(trajectory) - 1) // 16 * 16  # every full page of the last trajectory
        trajectory = prompt + choice["token_ids"]
    assert cached[0] < cached[1] < cached[2]
