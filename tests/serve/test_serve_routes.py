"""`rollout serve` returns routed experts as vLLM does: per choice, `routed_experts`, base64 `.npy` bytes of
`[prompt + completion - 1, L, k]` (`rollout.api.route_wire`); asked per request (`return_routed_experts`) or for
every request (`--enable-return-routed-experts`), off by default, a 400 naming the field on a dense model; and
`RolloutPool.generate(..., return_routed_experts=True)` gives the in-process engine's `batch.routed_experts`."""

from __future__ import annotations

import base64
import io

import pytest

for _mod in ("fastapi", "uvicorn", "prometheus_client", "httpx", "numpy"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from support.serving import make_tokenizer, save_tiny, serving  # noqa: E402
from support.tiny_models import make_model, random_prompts  # noqa: E402

from rollout import ContinuousBatchingConfig, RolloutEngine  # noqa: E402
from rollout.api.route_wire import decode_routes, encode_routes  # noqa: E402
from rollout.fleet.pool import RolloutPool  # noqa: E402
from rollout.serve.app import build_app  # noqa: E402
from rollout.serve.cli import load  # noqa: E402

CONFIG = dict(page_size=16, num_blocks=256)
PROMPTS = random_prompts(3, 5, 40, seed=3)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "model"
    make_model("qwen3_moe", seed=0).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(moe_dir):
    with serving(moe_dir, **CONFIG) as s:
        yield s


@pytest.fixture(scope="module")
def expected(moe_dir):
    """The in-process engine's greedy batch (routes on) over the same saved model."""
    model, tokenizer, gc = load(str(moe_dir), "float32")
    with RolloutEngine(model, tokenizer=tokenizer, config=ContinuousBatchingConfig(**CONFIG),
                       generation_config=gc) as engine:
        return engine.generate(PROMPTS, temps=0.0, max_new_tokens=MAX_TOKENS, return_routed_experts=True)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {server.key}"}, timeout=60)


def engine_rows(batch, i: int) -> torch.Tensor:
    """Row i's routes without padding and without the last sampled token: what the wire carries."""
    mask = batch.attention_mask[i].bool()
    return batch.routed_experts[i][mask][:-1]


def test_completion_routes_equal_the_engines(server, expected):
    r = post(server, "/v1/completions", {"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                                         "return_token_ids": True, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for i, c in enumerate(choices):
        arr = np.load(io.BytesIO(base64.b64decode(c["routed_experts"])), allow_pickle=False)  # NOTE: vLLM's decode
        assert arr.dtype == np.uint8  # 8 experts: the compact dtype
        assert arr.shape == (len(PROMPTS[i]) + len(c["token_ids"]) - 1, 2, 2)
        assert c["token_ids"] == expected.completion_ids[i][expected.completion_mask[i].bool()].tolist()
        assert torch.equal(torch.from_numpy(arr.astype(np.int16)), engine_rows(expected, i))


def test_pool_returns_the_engines_routed_experts(server, expected):
    with RolloutPool([server.url], api_key=server.key) as pool:
        batch = pool.generate(PROMPTS, temps=0.0, max_new_tokens=MAX_TOKENS, return_routed_experts=True)
        plain = pool.generate(PROMPTS[:1], temps=0.0, max_new_tokens=2)
    assert torch.equal(batch.input_ids, expected.input_ids.cpu())
    assert torch.equal(batch.routed_experts, expected.routed_experts.cpu())  # -1 at padding and the last token too
    assert plain.routed_experts is None


def test_chat_choice_carries_routes(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                              "temperature": 0, "return_token_ids": True,
                                              "return_routed_experts": True})
    assert r.status_code == 200, r.text
    body = r.json()
    routes = decode_routes(body["choices"][0]["routed_experts"])
    assert routes.shape == (len(body["prompt_token_ids"]) + len(body["choices"][0]["token_ids"]) - 1, 2, 2)
    assert (routes >= 0).all() and (routes < 8).all()


def test_stop_string_cut_still_returns_routes(server, expected):
    text = make_tokenizer().decode(expected.completion_ids[0][: MAX_TOKENS].tolist())
    stop = text[3]  # NOTE: the engine stops at its first occurrence, then the sample is cancelled
    r = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                                         "stop": [stop], "return_token_ids": True, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and len(c["token_ids"]) < MAX_TOKENS
    routes = decode_routes(c["routed_experts"])
    assert routes.shape[0] == len(PROMPTS[0]) + len(c["token_ids"]) - 1
    assert torch.equal(routes, engine_rows(expected, 0)[: routes.shape[0]])


def test_off_by_default_and_refused_with_stream(server):
    r = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200 and "routed_experts" not in r.json()["choices"][0]
    r = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "stream": True,
                                         "return_routed_experts": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"
    assert "stream" in r.json()["error"]["message"]


def test_server_flag_returns_routes_unasked(moe_dir):
    with serving(moe_dir, app_kwargs={"enable_return_routed_experts": True}, **CONFIG) as s:
        r = post(s, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 3, "return_token_ids": True})
        streamed = post(s, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 3, "stream": True})
    c = r.json()["choices"][0]
    assert decode_routes(c["routed_experts"]).shape == (len(PROMPTS[1]) + len(c["token_ids"]) - 1, 2, 2)
    assert streamed.status_code == 200 and "routed_experts" not in streamed.text  # NOTE: as vLLM, never streamed


def test_dense_model_asking_gets_a_400_naming_it(tmp_path):
    with serving(save_tiny(tmp_path / "dense"), **CONFIG) as s:
        r = post(s, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "return_routed_experts": True})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "return_routed_experts" and "dense" in err["message"]
        assert post(s, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2}).status_code == 200
        with pytest.raises(ValueError, match="return_routed_experts.*dense"):
            build_app(s.engine, enable_return_routed_experts=True)


def test_wire_dtypes_and_bad_payloads():
    assert decode_routes(encode_routes(torch.tensor([[[3, 300]]]))).tolist() == [[[3, 300]]]
    many = np.load(io.BytesIO(base64.b64decode(encode_routes(torch.tensor([[[3, 300]]])))))
    assert many.dtype == np.uint16
    holes = np.load(io.BytesIO(base64.b64decode(encode_routes(torch.tensor([[[-1, 5]]])))))
    assert holes.dtype == np.int16 and holes.tolist() == [[[-1, 5]]]
    with pytest.raises(ValueError, match="routed_experts is not base64"):
        decode_routes("not base64 !")
    flat = io.BytesIO()
    np.save(flat, np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="3-d integer array"):
        decode_routes(base64.b64encode(flat.getvalue()).decode())


def test_generate_route_routes_in_verifiers_shape(server, expected):
    """`/inference/v1/generate` with `return_routed_experts`: `{data: base64 uint8, shape: [T, L, k], start: 0}` (what
    verifiers' TrainClient decodes), the engine's routes of prompt + completion but the last token."""
    for i, prompt in enumerate(PROMPTS):
        r = post(server, "/inference/v1/generate", {"token_ids": prompt, "return_routed_experts": True,
                                                    "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        routes = choice["routed_experts"]
        assert set(routes) == {"data", "shape", "start"} and routes["start"] == 0
        arr = np.frombuffer(base64.b64decode(routes["data"]), dtype=np.uint8).reshape(routes["shape"])
        assert arr.shape == (len(prompt) + len(choice["token_ids"]) - 1, 2, 2)
        assert torch.equal(torch.from_numpy(arr.astype(np.int16)), engine_rows(expected, i))
    r = post(server, "/inference/v1/generate", {"token_ids": PROMPTS[0], "return_routed_experts": True,
                                                "stream": True, "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"
