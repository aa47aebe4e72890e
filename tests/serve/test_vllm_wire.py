"""vLLM 0.32's token-in/token-out and dev-mode control routes on `rollout serve`, checked against the captures of a
real vLLM server (`../shared/wire/vllm032-*.json`, copies in `tests/data/wire/`): the same keys and shapes, and the
behaviour the issue asks for (greedy equal to `/v1/completions`, seeded n=2 repeatable, streaming equal to
non-streaming, weight-version spans, 400s naming the field with the server serving on). One server per module."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from support.serving import call  # noqa: E402
from support.tiny_models import make_model  # noqa: E402

WIRE = Path(__file__).parents[1] / "data" / "wire"
PROMPT = [7, 30, 41, 9, 77, 12, 5, 66, 90, 3, 21, 54]


def fixture(name: str) -> dict:
    return json.loads((WIRE / name).read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.serving import save_tiny, serving

    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model")) as s:
        yield s


def generate(server, **sampling) -> dict:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 1234,
                                                     "ignore_eos": True, **sampling}, "return_token_ids": True}
    r = call(server, "POST", "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_response_has_vllm_shape(server):
    want = fixture("vllm032-generate-tokens.json")
    body = dict(want["request"], token_ids=PROMPT, model="tiny")
    body["sampling_params"] = dict(body["sampling_params"], ignore_eos=True)
    r = call(server, "POST", "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    got, ref = r.json(), want["response"]
    assert set(got) == set(ref)
    assert got["request_id"] == "generate-tokens-probe-1"
    assert got["prompt_token_ids"] == PROMPT and got["output_mode"] == "tokens"
    assert set(got["usage"]) == set(ref["usage"]) and got["usage"]["completion_tokens"] == 8
    (choice,) = got["choices"]
    assert set(choice) == set(ref["choices"][0])
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    # logprob entries: vLLM's keys plus `token` ("token_id:N", which verifiers requires)
    ref_entry = ref["choices"][0]["logprobs"]["content"][0]
    for tok, entry in zip(choice["token_ids"], choice["logprobs"]["content"], strict=True):
        assert set(entry) == set(ref_entry) | {"token"}
        assert entry["token_id"] == tok and entry["token"] == f"token_id:{tok}"
        # as vLLM 0.32: the sampled token first, then the most likely other, max(logprobs, 1) = 2 entries
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0] == {k: entry[k] for k in ("token_id", "token", "logprob", "rank")}
        other = entry["top_logprobs"][1]
        assert other["token_id"] != tok and other["rank"] == (2 if entry["rank"] == 1 else 1)
    # prompt_logprobs: None, then per prompt token a dict holding it (as vLLM: id -> logprob, rank, decoded_token)
    plp = got["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    for tok, d in zip(PROMPT[1:], plp[1:], strict=True):
        assert str(tok) in d and set(d[str(tok)]) == {"logprob", "rank", "decoded_token"}
        assert any(v["rank"] == 1 for v in d.values())


def test_logprobs_and_ranks_are_the_models(server):
    """Each token's logprob and rank against the model's own teacher-forced distribution (temperature 1, no
    warpers: the processed distribution is the model's softmax)."""
    got = generate(server, logprobs=3, temperature=1.0)
    (choice,) = got["choices"]
    model = make_model("qwen3", seed=0)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + choice["token_ids"]])).logits[0].float()
    dist = logits.log_softmax(-1)[len(PROMPT) - 1:-1]  # [T, V]: the distribution each token was drawn from
    for t, (tok, entry) in enumerate(zip(choice["token_ids"], choice["logprobs"]["content"], strict=True)):
        assert entry["logprob"] == pytest.approx(dist[t, tok].item(), abs=1e-3)
        assert entry["rank"] == int((dist[t] > dist[t, tok]).sum()) + 1
        top_ids = dist[t].topk(3).indices.tolist()
        others = [e["token_id"] for e in entry["top_logprobs"][1:]]
        assert others == [i for i in top_ids if i != tok][:2]


def test_greedy_equals_completions_and_seeded_n2_repeats(server):
    greedy = generate(server, temperature=0.0)["choices"][0]["token_ids"]
    r = call(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True})
    assert greedy == r.json()["choices"][0]["token_ids"]
    a, b = generate(server, n=2), generate(server, n=2)
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert a["choices"][0]["token_ids"] != a["choices"][1]["token_ids"]
    # as vLLM's capture: the first of n=2 is the n=1 sample of the same seed
    assert generate(server)["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]
    assert a["usage"]["completion_tokens"] == 16


def test_stream_equals_non_stream(server):
    body = {"request_id": "s1", "token_ids": PROMPT, "stream": True, "return_token_ids": True,
            "sampling_params": {"max_tokens": 8, "seed": 5, "logprobs": 1, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/inference/v1/generate", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {server.key}"}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    ref = [json.loads(c[6:]) for c in fixture("vllm032-generate-stream.json")["response"].split("\n\n")
           if c.startswith("data: {")]
    assert set(events[0]) == set(ref[0]) and set(events[1]) == set(ref[1])  # prompt ids on the first only
    tokens = [t for e in events for t in e["choices"][0]["token_ids"]]
    lps = [x["logprob"] for e in events for x in e["choices"][0]["logprobs"]["content"]]
    assert all(e["choices"][0]["weight_versions"] is None for e in events[:-1])
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["weight_versions"] == [{"version": "default", "start": 0,
                                                                              "end": 8}]
    whole = generate(server, seed=5, logprobs=1)["choices"][0]
    assert tokens == whole["token_ids"]
    assert lps == [x["logprob"] for x in whole["logprobs"]["content"]]


def test_weight_version_spans_and_info(server):
    assert call(server, "GET", "/weight_info").json() == {"weight_version": "default"}
    r = call(server, "POST", "/update_weight_version", {"new_version": "step-7"})
    assert r.json() == fixture("vllm032-update-weight-version.json")["response"]
    try:
        assert call(server, "GET", "/weight_info").json() == {"weight_version": "step-7"}
        choice = generate(server)["choices"][0]
        assert choice["weight_versions"] == [{"version": "step-7", "start": 0, "end": 8}]
    finally:
        call(server, "POST", "/update_weight_version", {"new_version": "default"})


def test_version_spans_split_where_versions_change(server):
    from rollout.serve.vllm_control import version_spans

    state = server.app.state
    v = server.engine.policy_version
    spans = version_spans(state, [v, v, v + 1, v + 1, v + 1])
    assert spans == [{"version": "default", "start": 0, "end": 2}, {"version": str(v + 1), "start": 2, "end": 5}]


@pytest.mark.parametrize("sampling, param", [
    ({"temperature": -1}, "sampling_params.temperature"),
    ({"top_p": 0}, "sampling_params.top_p"),
    ({"logprobs": 50}, "sampling_params.logprobs"),
    ({"n": 0}, "sampling_params.n"),
    ({"max_tokens": 100000}, "max_tokens"),
])
def test_bad_sampling_fields_are_400s_naming_them(server, sampling, param):
    r = call(server, "POST", "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": sampling})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and set(err) == {"message", "type", "param", "code"}
    assert generate(server)["choices"][0]["finish_reason"] == "length"  # still serving


def test_out_of_vocabulary_ids_are_400s(server):
    for ids, param in (([1, 2, 10**6], "token_ids"), ([], "token_ids"), ([1, "a"], "token_ids")):
        r = call(server, "POST", "/inference/v1/generate", {"token_ids": ids, "sampling_params": {}})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = call(server, "POST", "/inference/v1/generate",
             {"token_ids": PROMPT, "sampling_params": {"stop_token_ids": [10**6]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    assert generate(server)["usage"]["completion_tokens"] == 8


def test_unknown_harmless_fields_are_accepted(server):
    """What SkyRL and the render route send: output_kind, skip_clone, bad_words [], priority, cache_salt, ..."""
    body = fixture("vllm032-generate-from-render.json")["request"]
    body = dict(body, token_ids=PROMPT, model=None)
    r = call(server, "POST", "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["prompt_token_ids"] is None and len(got["choices"][0]["token_ids"]) <= 6


def test_abort_by_id_and_all(server):
    results = {}

    def run():
        r = call(server, "POST", "/inference/v1/generate", {
            "request_id": "long-1", "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 900, "ignore_eos": True}})
        results["r"] = r

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while "long-1" not in getattr(server.app.state, "generate_ids", {}):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = call(server, "POST", "/inference/v1/abort_requests", {"request_ids": ["long-1"]})
    assert r.status_code == 200
    t.join(60)
    choice = results["r"].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 900
    assert call(server, "POST", "/abort_requests", {}).json() == {"status": "aborted", "aborted": 0}
    assert call(server, "POST", "/abort_requests", {"request_ids": ["nope"]}).json()["aborted"] == 0


def test_render_generate_derender(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Reverse hello."}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 1, "temperature": 1.0, "seed": 7}
    rendered = call(server, "POST", "/v1/chat/completions/render", chat)
    assert rendered.status_code == 200, rendered.text
    gen = call(server, "POST", "/inference/v1/generate", rendered.json())
    assert gen.status_code == 200, gen.text
    body = {"generate_response": gen.json(), "prompt_token_ids": rendered.json()["token_ids"],
            "prompt_tokens": len(rendered.json()["token_ids"]), "chat_request": chat}
    r = call(server, "POST", "/v1/chat/completions/derender", body)
    assert r.status_code == 200, r.text
    out, ref = r.json(), fixture("vllm032-chat-derender.json")["response"]
    assert out["object"] == "chat.completion" and out["id"] == gen.json()["request_id"]
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant"
    tokens = gen.json()["choices"][0]["token_ids"]
    assert choice["message"]["content"] == server.app.state.tokenizer.decode(tokens, skip_special_tokens=True)
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == set(ref["choices"][0]["logprobs"]["content"][0])
    # the same chat request on /v1/chat/completions (same seed) says the same
    direct = call(server, "POST", "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    assert direct == choice["message"]["content"]
    bad = call(server, "POST", "/v1/chat/completions/derender", {"generate_response": {"choices": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "generate_response"


def test_control_routes(server):
    assert call(server, "GET", "/get_world_size").json() == {"world_size": 1}
    assert call(server, "GET", "/get_world_size", include_dp="false").json() == {"world_size": 1}
    info = call(server, "GET", "/server_info").json()
    assert info["served_model_name"] == "tiny" and info["context_length"]
    model = call(server, "GET", "/v1/models").json()["data"][0]
    assert model["max_model_len"] == info["context_length"]
    assert call(server, "POST", "/finish_session", session_id="s1").status_code == 200


def test_weight_checker_sees_a_change_of_weights(server, tmp_path):
    from support.serving import save_tiny

    first = call(server, "POST", "/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert len(first) > 10 and len(set(first.values())) > 3  # not the hash of empty input everywhere
    same = call(server, "POST", "/weight_checker", {"action": "compare", "baseline": first}).json()
    assert same == {"match": True, "mismatches": []}
    path = save_tiny(tmp_path / "other", seed=1)
    before = server.engine.policy_version
    r = call(server, "POST", "/update_weights_from_disk", {"model_path": str(path)})
    assert r.status_code == 200, r.text
    try:
        diff = call(server, "POST", "/weight_checker", {"action": "compare"}).json()
        assert not diff["match"] and "model.embed_tokens.weight" in diff["mismatches"]
        spans = generate(server)["choices"][0]["weight_versions"]
        assert spans == [{"version": str(before + 1), "start": 0, "end": 8}]
    finally:
        r = call(server, "POST", "/update_weights_from_disk", {"model_path": str(server.model_dir)})
        assert r.status_code == 200
    back = call(server, "POST", "/weight_checker", {"action": "compare", "baseline": first}).json()
    assert back["match"], back
    r = call(server, "POST", "/weight_checker", {"action": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "action"


def test_sampling_mask_on_the_wire(server):
    got = generate(server, top_k=3, return_sampling_mask=True, logprobs=0)
    choice = got["choices"][0]
    assert len(choice["sampling_mask"]) == 8
    for tok, mask, entry in zip(choice["token_ids"], choice["sampling_mask"], choice["logprobs"]["content"],
                                strict=True):
        assert tok in mask and len(mask) == 3 and mask == sorted(mask)
        assert entry["rank"] <= 3
    assert generate(server, top_k=3)["choices"][0]["sampling_mask"] is None


def test_completions_answer_areal_and_tinker_requests(server):
    """AReaL's RemotevLLMEngine body (no model, return_tokens_as_token_ids, top_k 1e8, use_beam_search false) and
    SkyRL's Tinker `logprobs: true`, as captured."""
    areal = fixture("clients/areal-1.0.4-vllm-backend.json")["calls"][0]
    r = call(server, "POST", "/v1/completions", dict(areal["request"], prompt=PROMPT[:5]))
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ref = areal["response"]["choices"][0]["logprobs"]
    assert set(lp) == set(ref)
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    # NOTE: sampled at temperature 1 with EOS honoured, as AReaL sends it: 6 tokens, or fewer ending on a stop
    choice = r.json()["choices"][0]
    assert len(lp["tokens"]) == 6 or (len(lp["tokens"]) < 6 and choice["finish_reason"] == "stop"), choice
    assert list(lp["top_logprobs"][0]) == [lp["tokens"][0]]
    r = call(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": True, "n": 2,
                                                 "seed": 3, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_pool_batches_carry_sampling_masks(server):
    """`RolloutBatch.sampling_masks` through a pool (`/v1/completions` with return_sampling_mask): the masks and tokens
    the server's own generate route gives the same seeded request."""
    from rollout import SamplingParams
    from rollout.fleet.pool import RolloutPool

    sp = SamplingParams(temperature=1.0, top_k=3, seed=11, max_tokens=5, ignore_eos=True, return_sampling_mask=True)
    with RolloutPool([server.url], api_key=server.key, weight_transfer="disk") as pool:
        batch = pool.generate([PROMPT], group_size=2, sampling=sp)
    direct = generate(server, n=2, top_k=3, seed=11, max_tokens=5, return_sampling_mask=True)["choices"]
    assert batch.sampling_masks == [c["sampling_mask"] for c in direct]
    assert batch.completion_ids.tolist() == [c["token_ids"] for c in direct]
    assert all(len(m) == 3 for row in batch.sampling_masks for m in row)
