"""vLLM's LoRA routes on `rollout serve` (`rollout.serve.lora_routes`): load a PEFT directory, completions and chat
with `"model": lora_name` equal to the adapter's PeftModel and to the in-process engine, `/v1/models`, unload, and
the 400 / 404 answers naming the problem."""

from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "peft"):
    pytest.importorskip(_mod, reason=f"these tests need {_mod} (pip install -e '.[serve,lora,dev]')")

import httpx  # noqa: E402
from support.lora import make_peft  # noqa: E402
from support.serving import save_tiny, serving  # noqa: E402
from support.tiny_models import hf_greedy, make_model, random_prompts  # noqa: E402

NEW = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two PEFT adapters of the tiny server model, saved with save_pretrained: (PeftModel, directory) each."""
    root = tmp_path_factory.mktemp("lora")
    base = make_model("qwen3", seed=0)  # NOTE: the weights `save_tiny` saves
    out = {}
    for name, seed, r, targets in (("a", 1, 4, "all-linear"), ("b", 2, 8, ["q_proj", "v_proj"])):
        model = make_peft(base, seed=seed, r=r, targets=targets)
        model.save_pretrained(root / name)
        out[name] = (model, str(root / name))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model"), max_loras=2, max_lora_rank=8) as s:
        yield s


def post(server, path, body):
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {server.key}"}, timeout=60)


def models(server) -> dict[str, dict]:
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {server.key}"}, timeout=60)
    return {m["id"]: m for m in r.json()["data"]}


def complete(server, model: str, prompt: list[int]) -> dict:
    r = post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                                         "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_load_serve_list_and_unload(server, adapters):
    for name, (_, path) in adapters.items():
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == 200 and name in r.text, r.text
    listed = models(server)
    assert set(listed) == {"tiny", "a", "b"}
    assert listed["a"]["root"] == adapters["a"][1] and listed["a"]["parent"] == "tiny"
    prompts = random_prompts(3, 5, 25, seed=5)
    base = make_model("qwen3", seed=0)
    for prompt in prompts:
        for name in ("a", "b", "tiny"):
            body = complete(server, name, prompt)
            oracle = adapters[name][0] if name != "tiny" else base
            assert body["choices"][0]["token_ids"] == hf_greedy(oracle, prompt, NEW), (name, prompt)
            assert body["model"] == name
    inproc = server.engine.generate(prompts, temps=0.0, max_new_tokens=NEW, lora="b")
    for i, prompt in enumerate(prompts):
        assert complete(server, "b", prompt)["choices"][0]["token_ids"] == inproc.completion_ids[i].tolist()
    r = post(server, "/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["model"] == "a", r.text

    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["b"][1]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["b"][1], "load_inplace": True})
    assert r.status_code == 200, r.text  # NOTE: in place: "a" now holds b's tensors
    assert complete(server, "a", prompts[0])["choices"][0]["token_ids"] == hf_greedy(adapters["b"][0], prompts[0], NEW)

    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 200, r.text
    assert set(models(server)) == {"tiny", "b"}
    r = post(server, "/v1/completions", {"model": "a", "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "`a`" in r.json()["error"]["message"]
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


def test_bad_loads_name_the_problem(server, adapters, tmp_path):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "adapter_config.json" in r.json()["error"]["message"]
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": adapters["a"][1]})
    assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
    r = post(server, "/v1/load_lora_adapter", {"lora_path": adapters["a"][1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_a_server_without_lora_refuses_loads(tmp_path, adapters):
    with serving(save_tiny(tmp_path / "model")) as s:
        r = post(s, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"][1]})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_an_adapter_pushed_in_memory_over_the_weight_transfer_path(server):
    from support.lora import redraw

    from rollout.client import RolloutClient

    base = make_model("qwen3", seed=0)
    pushed = make_peft(base, seed=21, r=4, targets=["q_proj", "down_proj"], use_rslora=True)
    prompt = random_prompts(1, 20, 20, seed=8)[0]
    with RolloutClient(server.url, server.key) as client:
        assert client.push_lora("pushed", pushed) == 1
        assert complete(server, "pushed", prompt)["choices"][0]["token_ids"] == hf_greedy(pushed, prompt, NEW)
        assert "pushed" in models(server)
        redraw(pushed, seed=22)
        assert client.push_lora("pushed", pushed) == 2
        assert complete(server, "pushed", prompt)["choices"][0]["token_ids"] == hf_greedy(pushed, prompt, NEW)
        too_big = make_peft(base, seed=23, r=16, targets=["q_proj"])
        with pytest.raises(RuntimeError, match="max_lora_rank=8"):
            client.push_lora("pushed", too_big)
        assert complete(server, "pushed", prompt)["choices"][0]["token_ids"] == hf_greedy(pushed, prompt, NEW)
    post(server, "/v1/unload_lora_adapter", {"lora_name": "pushed"})
