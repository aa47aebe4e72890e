"""SGLang's native API on `rollout serve` (`rollout.serve.sglang_routes`, `rollout.serve.sglang_weights`):
the shapes SGLang's clients parse (slime / miles, AReaL's `RemoteSGLangEngine`, sglang-router's probes),
tokens and logprobs equal to the OpenAI route's and the engine's, pause / abort, weights from disk, tensors
and a trainer's SGLang-style group over gloo, and bad input answered with a 400 naming the field. One server
per module.

Run as a script (`python tests/serve/test_serve_sglang.py trainer URL KEY SEED PORT`) it is a trainer process
that joins the server's group the way SGLang's `init_custom_process_group` does and broadcasts a tiny
model's weights."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

if __name__ != "__main__":
    for _mod in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from support.serving import call  # noqa: E402
from support.tiny_models import hf_greedy, make_model  # noqa: E402

PROMPT = [7, 30, 41, 9, 77, 12, 5, 66, 90, 3, 21, 54]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.serving import save_tiny, serving

    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model")) as s:
        yield s


def generate(server, body) -> httpx.Response:
    return call(server, "POST", "/generate", body)


def greedy_body(prompt=PROMPT, n=8, **extra) -> dict:
    sampling = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    return {"input_ids": prompt, "sampling_params": sampling, **extra}


def stream_chunks(server, body, sink: list, started: threading.Event) -> None:
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {server.key}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                sink.append(json.loads(line[6:]))
                if sink[-1]["output_ids"]:
                    started.set()


def test_greedy_tokens_and_logprobs_equal_the_completions_route_and_the_engine(server):
    r = generate(server, greedy_body(return_logprob=True, rid="req-1"))
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    c = call(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True,
                                                  "logprobs": 0}).json()["choices"][0]
    assert out["output_ids"] == c["token_ids"] == hf_greedy(make_model("qwen3", seed=0), PROMPT, 8)
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    logprobs = [e[0] for e in meta["output_token_logprobs"]]
    assert logprobs == c["logprobs"]["token_logprobs"]
    batch = server.engine.generate([PROMPT], temps=[0.0], max_new_tokens=8)  # NOTE: the engine, no server
    assert batch.completion_ids[0].tolist() == out["output_ids"]
    assert logprobs == pytest.approx(batch.logprobs[0].tolist(), abs=1e-6)
    assert meta["id"] == "req-1" and meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 8
    assert meta["weight_version"] == call(server, "GET", "/get_weight_version").json()["weight_version"]
    assert all(e[2] is None for e in meta["output_token_logprobs"]) and meta["input_token_logprobs"] == []
    assert out["text"] == server.engine.tokenizer.decode(out["output_ids"])


def test_text_prompt_batches_n_and_prompt_logprobs(server):
    tok = server.engine.tokenizer
    r = generate(server, {"text": ["hello", "abc"], "return_logprob": True, "logprob_start_len": 0,
                          "top_logprobs_num": 2, "return_text_in_logprobs": True,
                          "sampling_params": {"max_new_tokens": 4, "temperature": 0.9, "n": 2,
                                              "sampling_seed": 5, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 4  # prompt-major: hello x2, abc x2
    for k, text in enumerate(["hello", "hello", "abc", "abc"]):
        meta = outs[k]["meta_info"]
        ids = tok(text)["input_ids"]
        assert meta["prompt_tokens"] == len(ids)
        inputs = meta["input_token_logprobs"]
        assert [e[1] for e in inputs] == ids and inputs[0][0] is None and all(e[0] < 0 for e in inputs[1:])
        assert [e[2] for e in inputs] == [tok.decode([i]) for i in ids]
        assert len(meta["output_top_logprobs"]) == 4 and all(len(p) == 2 for p in meta["output_top_logprobs"])
        for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
            assert top[0][0] >= chosen[0] - 1e-6  # the likeliest token is at least as likely as the drawn one
    again = generate(server, {"text": ["hello", "abc"], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0.9, "n": 2, "sampling_seed": 5, "ignore_eos": True}}).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]  # seeded
    # the prompt's teacher-forced logprobs equal the scores the completions route returns (echo)
    scored = call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 1, "echo": True,
                                                      "logprobs": 1, "temperature": 0.9})
    scored = scored.json()["choices"][0]["logprobs"]
    assert [e[0] for e in outs[0]["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(
        scored["token_logprobs"][1:len(tok("hello")["input_ids"])], abs=1e-5)


def test_stream_sends_the_whole_output_so_far_then_done(server):
    chunks: list = []
    stream_chunks(server, greedy_body(n=6), chunks, threading.Event())
    full = generate(server, greedy_body(n=6)).json()
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 7))
    assert chunks[-1]["output_ids"] == full["output_ids"] and chunks[-1]["text"] == full["text"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 5
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_stop_token_and_stop_string_finish_reasons(server):
    first = generate(server, greedy_body(n=8)).json()["output_ids"]
    stop = first[3]
    r = generate(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                   "stop_token_ids": [stop]}}).json()
    assert r["output_ids"] == first[: first.index(stop) + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    text = server.engine.tokenizer.decode(first)
    cut = text[2:4]
    r = generate(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                   "stop": [cut]}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": cut}
    assert r["text"] == text[: text.index(cut)]


@pytest.mark.parametrize("body, param", [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
    ({"input_ids": [1, 500]}, "input_ids"),
    ({"text": "a", "input_ids": [1]}, "input_ids"),
    ({}, "text"),
    ({"input_ids": "x"}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "max_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [900]}}, "stop_token_ids"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"input_ids": [1, 2], "top_logprobs_num": 99}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "image_data": "http://x/y.png"}, "image_data"),
    ({"input_ids": [1, 2], "lora_path": "nope"}, "lora_path"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(server, body, param):
    r = generate(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert generate(server, greedy_body(n=2)).status_code == 200


def test_pause_in_place_keeps_in_flight_work_and_abort_mode_cancels_it(server):
    expected = generate(server, greedy_body([4] * 10, n=150)).json()["output_ids"]
    chunks: list = []
    started = threading.Event()
    t = threading.Thread(target=stream_chunks, args=(server, greedy_body([4] * 10, n=150), chunks, started))
    t.start()
    assert started.wait(60)
    assert call(server, "POST", "/pause_generation", {"mode": "in_place"}).status_code == 200
    time.sleep(0.3)  # NOTE: a step under way when the pause came may still deliver one chunk
    frozen = len(chunks)
    time.sleep(0.7)
    assert len(chunks) == frozen and t.is_alive() and len(chunks[-1]["output_ids"]) < 150
    assert call(server, "GET", "/server_info").json()["is_paused"] is True
    assert call(server, "POST", "/continue_generation").json()["status"] == "ok"
    t.join(60)
    assert chunks[-1]["output_ids"] == expected  # the paused request went on to the same greedy tokens
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # the default mode, "abort", cancels what runs: the request answers at once with finish_reason abort
    box: dict = {}
    chunks, started = [], threading.Event()
    t = threading.Thread(target=stream_chunks, args=(server, greedy_body([4] * 10, n=400), chunks, started))
    t.start()
    assert started.wait(60)
    assert call(server, "POST", "/pause_generation", {}).status_code == 200
    t.join(30)
    assert not t.is_alive() and chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(chunks[-1]["output_ids"]) < 400
    assert call(server, "POST", "/pause_generation", {"mode": "bogus"}).json()["error"]["param"] == "mode"
    assert call(server, "POST", "/continue_generation").status_code == 200
    assert not box


def test_abort_request_by_rid_and_all(server):
    chunks: list = []
    started = threading.Event()
    body = {**greedy_body([5] * 8, n=400), "rid": "long-one"}
    t = threading.Thread(target=stream_chunks, args=(server, body, chunks, started))
    t.start()
    assert started.wait(60)
    assert call(server, "POST", "/abort_request", {"rid": "someone-else"}).status_code == 200
    time.sleep(0.2)
    assert t.is_alive()
    assert call(server, "POST", "/abort_request", {"rid": "long-one"}).status_code == 200
    t.join(30)
    assert not t.is_alive()
    final = chunks[-1]["meta_info"]
    assert final["id"] == "long-one" and final["finish_reason"]["type"] == "abort"
    assert call(server, "POST", "/abort_request", {}).json()["error"]["param"] == "rid"
    chunks, started = [], threading.Event()
    t = threading.Thread(target=stream_chunks, args=(server, greedy_body([6] * 8, n=400), chunks, started))
    t.start()
    assert started.wait(60)
    assert call(server, "POST", "/abort_request", {"abort_all": True}).status_code == 200
    t.join(30)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_info_health_flush_and_memory_routes(server):
    for path in ("/server_info", "/get_server_info"):
        info = call(server, "GET", path).json()
        assert info["served_model_name"] == "tiny" and info["context_length"] > 0
    for path in ("/model_info", "/get_model_info"):
        assert call(server, "GET", path).json()["is_generation"] is True
    assert call(server, "GET", "/health_generate").status_code == 200
    before = generate(server, greedy_body()).json()
    assert server.engine.manager.cache_stats()["cached_pages"] >= 0
    r = call(server, "POST", "/flush_cache")
    assert r.status_code == 200 and server.engine.manager.cache_stats()["cached_pages"] == 0
    assert call(server, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).json()["success"]
    assert call(server, "GET", "/server_info").json()["is_sleeping"] is True
    bad = call(server, "POST", "/release_memory_occupation", {"tags": ["gpu"]})
    assert bad.json()["error"]["param"] == "tags"
    assert call(server, "POST", "/resume_memory_occupation", {}).json()["success"]
    assert generate(server, greedy_body()).json()["output_ids"] == before["output_ids"]


def test_update_weights_from_disk_changes_greedy_tokens_and_weight_version(server, tmp_path):
    from support.serving import save_tiny

    v0 = call(server, "GET", "/get_weight_version").json()["weight_version"]
    old = generate(server, greedy_body()).json()
    path = str(save_tiny(tmp_path / "m1", seed=1))
    r = call(server, "POST", "/update_weights_from_disk", {"model_path": path, "weight_version": "step-1"})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == v0 + 1, r.text
    new = generate(server, greedy_body()).json()
    assert new["output_ids"] == hf_greedy(make_model("qwen3", seed=1), PROMPT, 8) != old["output_ids"]
    assert new["meta_info"]["weight_version"] == "step-1"
    assert call(server, "GET", "/get_model_info").json()["weight_version"] == "step-1"
    bad = call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model_path"
    assert generate(server, greedy_body()).json()["output_ids"] == new["output_ids"]
    call(server, "POST", "/update_weights_from_disk", {"model_path": str(save_tiny(tmp_path / "m0", seed=0))})


def test_update_weights_from_tensor_in_sglang_encoding(server):
    from rollout.serve.sglang_weights import serialize

    state = make_model("qwen3", seed=2).state_dict()
    r = call(server, "POST", "/update_weights_from_tensor",
             {"serialized_named_tensors": [serialize(list(state.items()))], "weight_version": "t2"})
    assert r.status_code == 200, r.text
    out = generate(server, greedy_body()).json()
    assert out["output_ids"] == hf_greedy(make_model("qwen3", seed=2), PROMPT, 8)
    assert out["meta_info"]["weight_version"] == "t2"
    import base64
    import pickle

    evil = base64.b64encode(pickle.dumps([("x", __import__("os").system)])).decode()
    r = call(server, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    assert r.status_code == 400 and "not a tensor part" in r.json()["error"]["message"]
    r = call(server, "POST", "/update_weights_from_tensor",
             {"serialized_named_tensors": [serialize([("model.nope.weight", state["lm_head.weight"])])]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "serialized_named_tensors"
    assert generate(server, greedy_body()).json()["output_ids"] == out["output_ids"]
    call(server, "POST", "/update_weights_from_tensor",
         {"serialized_named_tensors": [serialize(list(make_model("qwen3", seed=0).state_dict().items()))]})


def test_trainer_broadcasts_weights_through_an_sglang_style_group_over_gloo(server):
    seed = 3
    port = _free_port()
    cmd = [sys.executable, __file__, "trainer", server.url, server.key, str(seed), str(port)]
    proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["init"] == 200 and result["update"] == 200 and result["bad"] == 400, out
    got = generate(server, greedy_body()).json()
    assert got["output_ids"] == hf_greedy(make_model("qwen3", seed=seed), PROMPT, 8)
    assert got["meta_info"]["weight_version"] == "dist-3"
    r = call(server, "POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "group_name"  # destroyed by the trainer
    r = call(server, "POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                            "world_size": 2, "backend": "nccl"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "backend"


def test_routed_experts_in_the_encoding_areal_decodes(tmp_path):
    """An MoE policy: `meta_info.routed_experts` is base64 raw int32 `[prompt + completion - 1, layers * k]`
    (AReaL's `np.frombuffer(...).reshape(prompt_tokens + completion_tokens - 1, -1)`), the engine's routes."""
    import base64

    import numpy as np
    from support.serving import make_tokenizer, serving

    model_dir = tmp_path / "moe"
    make_model("qwen3_moe", seed=0).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    with serving(model_dir) as moe:
        r = generate(moe, greedy_body(n=5, return_routed_experts=True))
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
        got = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(rows, -1)
        batch = moe.engine.generate([PROMPT], temps=[0.0], max_new_tokens=5, return_routed_experts=True)
        want = batch.routed_experts[0][:rows].reshape(rows, -1).numpy()
        assert got.shape == want.shape and (got == want).all()
        plain = generate(moe, greedy_body(n=2)).json()["meta_info"]
        assert "routed_experts" not in plain


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(url: str, key: str, seed: int, port: int) -> None:
    """SGLang's trainer side: `init_custom_process_group` (rendezvous, a PrefixStore named after the group,
    `_new_process_group_helper`), the HTTP calls on a thread, then one `broadcast` per tensor in order."""
    import concurrent.futures as cf
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    headers = {"Authorization": f"Bearer {key}"}
    name = "weight_update_group"
    pool = cf.ThreadPoolExecutor(1)
    init = pool.submit(httpx.post, url + "/init_weights_update_group", headers=headers, timeout=120, json={
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"})
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timedelta(seconds=60)))
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(world, rank, [], dist.Backend("gloo"), store, group_name=name,
                                      timeout=timedelta(seconds=60))
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    codes = {"init": init.result().status_code}
    state = make_model("qwen3", seed=seed).state_dict()

    def push(items, **extra):
        body = {"names": [n for n, _ in items],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items], "group_name": name, **extra}
        reply = pool.submit(httpx.post, url + "/update_weights_from_distributed", json=body, headers=headers,
                            timeout=120)
        for _, t in items:
            dist.broadcast(t.contiguous(), src=0, group=pg)
        return reply.result()

    codes["bad"] = push([("model.not_a_layer.weight", torch.zeros(3))]).status_code  # received, then refused
    codes["update"] = push(list(state.items()), weight_version=f"dist-{seed}").status_code
    codes["destroy"] = httpx.post(url + "/destroy_weights_update_group", json={"group_name": name},
                                  headers=headers, timeout=30).status_code
    print(json.dumps(codes))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "trainer":
    _trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
