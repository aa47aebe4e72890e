"""What clients of `vllm serve` rely on, against `rollout serve` on 127.0.0.1: chat content as a list of parts
(joined for a string template, passed as parts to a template that iterates them, a non-text part refused),
`/tokenize` and `/detokenize`, vLLM's render routes, `/version`, `/ping`, `/v1/models` fields, `usage` on every streamed
chunk with `continuous_usage_stats`, and `/metrics` open while `/v1/*` stays behind the key (guarded with the flag).

Two servers for the module: `plain` (the string template of `support.serving`) and `parts` (`PARTS_TEMPLATE`,
a tokenizer that adds <s>, and `metrics_require_api_key=True`)."""

from __future__ import annotations

import json

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
import openai  # noqa: E402
from support.serving import make_parts_tokenizer, make_tokenizer, save_tiny, serving  # noqa: E402

PARTS = [{"type": "text", "text": "12+"}, {"type": "text", "text": "34="}]
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("plain") / "model")
    with serving(path, app_kwargs={"model_root": str(path)}) as s:
        yield s


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("parts") / "model", tokenizer=make_parts_tokenizer())
    with serving(path, app_kwargs={"metrics_require_api_key": True}) as s:
        yield s


def post(server, path: str, body: dict, key: str | None = "default") -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.key if key == 'default' else key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def chat_prompt_ids(server, content) -> list[int]:
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


# ------------------------------------------------------------------------------------ content parts
def test_list_content_on_a_string_template_is_the_joined_string(plain):
    tok = make_tokenizer()
    ids = chat_prompt_ids(plain, PARTS)
    assert ids == chat_prompt_ids(plain, "12+\n34=")
    assert tok.decode(ids) == "<|im_start|>user\n12+\n34=<|im_end|>\n<|im_start|>assistant\n"
    # a bare {"text": ...} part (vLLM takes it) and a one-part list are text too
    assert chat_prompt_ids(plain, [{"text": "12+"}, PARTS[1]]) == ids
    assert chat_prompt_ids(plain, [{"type": "text", "text": "hi"}]) == chat_prompt_ids(plain, "hi")


def test_list_content_reaches_a_parts_template_as_parts(parts):
    tok = make_parts_tokenizer()
    ids = chat_prompt_ids(parts, PARTS)
    assert tok.decode(ids) == "<|im_start|>user\n<12+><34=><|im_end|>\n<|im_start|>assistant\n"
    as_string = tok.decode(chat_prompt_ids(parts, "12+\n34="))  # NOTE: a string is not split into parts
    assert as_string == "<|im_start|>user\n12+\n34=<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("which", ["plain", "parts"])
def test_a_non_text_part_is_a_400_naming_it(route, which, request):
    server = request.getfixturevalue(which)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [PARTS[0], image]}]
    r = post(server, route, {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["code"] == 400 and err["type"] == "invalid_request_error"
    assert "messages[1].content[1]" in err["message"] and "'image_url'" in err["message"]
    for bad in ([{"type": "text"}], ["12+"], {"text": "12+"}):
        r = post(server, route, {"messages": [{"role": "user", "content": bad}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "messages[0].content" in r.json()["error"]["message"]


# --------------------------------------------------------------------------------- tokenize routes
def test_tokenize_and_detokenize_agree_with_the_tokenizer_and_template(plain, parts):
    from rollout.api.chat import chat_template_ids

    for server, tok in ((plain, make_tokenizer()), (parts, make_parts_tokenizer())):
        text = "Once upon a time"
        r = post(server, "/tokenize", {"prompt": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tok(text)["input_ids"] and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == server.app.state.bridge.max_model_len and body["max_model_len"] > 0
        bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert bare == tok(text, add_special_tokens=False)["input_ids"]
        assert post(server, "/detokenize", {"tokens": bare}).json() == {"prompt": text}
        assert post(server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"] == tok.decode(body["tokens"])
        for content in ("12+\n34=", PARTS):
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
            got = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
            assert got == chat_template_ids(tok, messages)  # NOTE: the template's ids, no specials added
            r = post(server, "/v1/chat/completions", {"messages": messages, **GREEDY})
            assert got == r.json()["prompt_token_ids"]
            with_bos = post(server, "/tokenize", {"messages": messages, "add_special_tokens": True}).json()["tokens"]
            assert with_bos == ([2] if server is parts else []) + got  # the parts tokenizer adds <s>
            no_gen = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
            assert no_gen == chat_template_ids(tok, messages, add_generation_prompt=False) != got


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": [1, 128]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
])
def test_tokenize_bad_input_is_400_naming_the_field(plain, path, body, param):
    r = post(plain, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_render_routes_give_the_generating_routes_prompt_ids_and_generate_nothing(plain, parts):
    for server, tok in ((plain, make_tokenizer()), (parts, make_parts_tokenizer())):
        before = server.engine.cache_stats()["generated_tokens"]
        r = post(server, "/v1/completions/render", {"prompt": ["Once upon", "a time"], "max_tokens": 3,
                                                    "temperature": 0.5, "stream": True})
        assert r.status_code == 200, r.text
        first, second = r.json()  # NOTE: vLLM's shape: one token-in GenerateRequest per prompt
        assert first["token_ids"] == tok("Once upon")["input_ids"] and second["token_ids"] == tok("a time")["input_ids"]
        assert first["request_id"].startswith("cmpl-") and first["request_id"] != second["request_id"]
        assert first["model"] == "tiny" and first["stream"] is True and first["token_offsets"] is None
        assert first["sampling_params"]["max_tokens"] == 3 and first["sampling_params"]["temperature"] == 0.5
        generated = post(server, "/v1/completions", {"prompt": "Once upon", **GREEDY}).json()
        assert generated["choices"][0]["prompt_token_ids"] == first["token_ids"]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PARTS}]
        r = post(server, "/v1/chat/completions/render", {"messages": messages, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200, r.text
        chat = r.json()
        assert chat["request_id"].startswith("chatcmpl-") and chat["sampling_params"]["logprobs"] == 2
        assert chat["token_ids"] == post(server, "/v1/chat/completions", {"messages": messages, **GREEDY}).json()[
            "prompt_token_ids"]
        assert server.engine.cache_stats()["generated_tokens"] == before + 2 * GREEDY["max_tokens"]
        assert (
            post(server, "/v1/completions/render", {"prompt": "a", "model": "nope"}).json()["error"]["param"] == "model"
        )
        assert post(server, "/v1/chat/completions/render", {"messages": messages}, key=None).status_code == 401


def test_version_ping_and_models_entry(plain):
    assert httpx.get(plain.url + "/version").json()["version"]
    assert httpx.get(plain.url + "/ping").status_code == 200 and httpx.post(plain.url + "/ping").status_code == 200
    r = httpx.get(plain.url + "/v1/models", headers={"Authorization": f"Bearer {plain.key}"})
    entry = r.json()["data"][0]
    assert entry["id"] == "tiny" and entry["root"] == str(plain.model_dir) and entry["parent"] is None
    assert entry["max_model_len"] == plain.app.state.bridge.max_model_len


# ------------------------------------------------------------------------------------ usage per chunk
@pytest.mark.parametrize("chat", [False, True])
def test_usage_on_every_chunk_only_with_continuous_usage_stats(plain, chat):
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key=plain.key, max_retries=0, timeout=60)
    kw = dict(model="tiny", max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True})
    make = client.chat.completions.create if chat else client.completions.create
    kw.update({"messages": [{"role": "user", "content": "count"}]} if chat else {"prompt": "count"})
    prompt_len = len(post(plain, "/tokenize", {"messages": kw["messages"]} if chat else {"prompt": "count"})
                     .json()["tokens"])
    for continuous in (True, False):
        options = {"include_usage": True, "continuous_usage_stats": continuous}
        chunks = list(make(stream_options=options, **kw))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
        assert chunks[-1].usage.prompt_tokens == prompt_len
        body = chunks[:-1]
        if continuous:
            assert all(c.usage is not None for c in body)
            done = [c.usage.completion_tokens for c in body]
            assert done == sorted(done) and done[-1] == 6 and (done[0] == 0) == chat
            assert all(c.usage.prompt_tokens == prompt_len for c in body)
            assert all(c.usage.total_tokens == prompt_len + c.usage.completion_tokens for c in body)
        else:
            assert all(c.usage is None for c in body)
    chunks = list(make(stream_options={"continuous_usage_stats": True}, **kw))  # NOTE: vLLM: needs include_usage
    assert all(c.usage is None for c in chunks)


# --------------------------------------------------------------------------------------- metrics key
def test_metrics_open_v1_guarded_and_the_flag_guards_metrics(plain, parts):
    r = httpx.get(plain.url + "/metrics")
    assert r.status_code == 200 and "rollout_free_blocks" in r.text
    for server in (plain, parts):
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert post(server, "/v1/completions", {"prompt": "a"}, key=None).status_code == 401
        assert post(server, "/tokenize", {"prompt": "a"}, key=None).status_code == 401
        assert post(server, "/pause", {}, key="wrong").status_code == 401
        assert httpx.get(server.url + "/ping").status_code == 200
    for key in (None, "wrong"):
        r = httpx.get(parts.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(parts.url + "/metrics", headers={"Authorization": f"Bearer {parts.key}"})
    assert r.status_code == 200 and "rollout_free_blocks" in r.text
    assert json.loads(httpx.get(parts.url + "/version").text)["version"]
