"""AReaL 1.0.4's `RemoteSGLangEngine` (its SGLang client: `/generate` with `input_ids` and `return_logprob`,
`/pause_generation`, `/continue_generation`, `/update_weights_from_disk`) against `rollout serve`'s SGLang
routes.

AReaL pins other versions of our dependencies, so it lives in a venv of its own (`.ci/framework_clients` makes
one: `pip install --no-deps areal==1.0.4` and the small packages its client imports, our packages seen through
a `.pth`); the test runs this file as a client script with the Python named by `ROLLOUT_AREAL_PYTHON` and
skips without it. The server has no API key: AReaL's HTTP client sends none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PYTHON = os.environ.get("ROLLOUT_AREAL_PYTHON")
if __name__ != "__main__":
    if not PYTHON or not Path(PYTHON).is_file():
        pytest.skip("no AReaL client (pip install --no-deps areal==1.0.4 and its client's imports in a venv "
                    "of its own, as .ci/framework_clients does, then set ROLLOUT_AREAL_PYTHON to its python)",
                    allow_module_level=True)
    pytest.importorskip("uvicorn")
    pytestmark = pytest.mark.timeout(600)

sys.path.insert(0, str(Path(__file__).parents[1]))

PROMPT = [7, 30, 41, 9, 77, 12, 5, 66, 90, 3, 21, 54]


def test_areal_remote_sglang_engine_generates_pauses_and_loads_weights_from_disk(tmp_path):
    from support.serving import save_tiny, serving
    from support.tiny_models import hf_greedy, make_model

    new_dir = save_tiny(tmp_path / "new", seed=1)
    with serving(save_tiny(tmp_path / "model"), key=None) as server:
        cmd = [PYTHON, __file__, "client", server.url.removeprefix("http://"), str(new_dir), str(tmp_path)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            # NOTE: the client pauses once the long request runs: the server holds a live request (it has no
            # other work then), and the go file tells the client so
            go, deadline = tmp_path / "go", time.monotonic() + 300
            while not (tmp_path / "long-sent").exists() or not server.engine.manager.debug_state()["live"]:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-5000:]
                time.sleep(0.01)
            go.touch()
            stdout, stderr = proc.communicate(timeout=400)
        finally:
            proc.kill()
        assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
        out = json.loads(stdout.strip().splitlines()[-1])
        old, new = make_model("qwen3", seed=0), make_model("qwen3", seed=1)
        assert out["greedy"]["tokens"] == hf_greedy(old, PROMPT, 8)
        assert out["greedy"]["stop_reason"] == "length" and len(out["greedy"]["logprobs"]) == 8
        assert all(lp < 0 for lp in out["greedy"]["logprobs"])
        # a pause (SGLang's default mode: abort) mid-request: AReaL resubmits prompt + tokens so far after the
        # continue, and greedy decoding ends where an unpaused request would
        assert out["paused"]["tokens"] == hf_greedy(old, PROMPT, 120) and out["paused"]["aborted_calls"] >= 1
        assert out["after_disk"]["tokens"] == hf_greedy(new, PROMPT, 8) != out["greedy"]["tokens"]
        assert server.engine.policy_version == 1


# ------------------------------------------------------------------------------------ the AReaL client
def _client(addr: str, new_dir: str, tmp: str) -> None:
    import asyncio
    import threading

    import areal.engine.sglang_remote as sgl
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
    from areal.api.io_struct import ModelRequest, WeightUpdateMeta
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.utils import name_resolve, names

    calls = {"abort": 0}
    parse = sgl.SGLangBackend.parse_generation_response

    def counting(self, response):  # NOTE: counts the answers cut by the pause
        result = parse(self, response)
        calls["abort"] += result.stop_reason == "abort"
        return result

    sgl.SGLangBackend.parse_generation_response = counting
    exp, trial = f"rollout-test-{os.getpid()}", "t0"
    config = InferenceEngineConfig(experiment_name=exp, trial_name=trial, request_timeout=120,
                                   setup_timeout=60, pause_grace_period=0.5)
    engine = RemoteSGLangEngine(config)
    engine.initialize(addr=addr, train_data_parallel_size=1)
    result: dict = {}

    def run(req):
        return asyncio.run(engine.agenerate(req))

    greedy = GenerationHyperparameters(max_new_tokens=8, greedy=True, ignore_eos=True)
    r = run(ModelRequest(input_ids=list(PROMPT), gconfig=greedy))
    result["greedy"] = {"tokens": r.output_tokens, "logprobs": r.output_logprobs,
                        "stop_reason": r.stop_reason}

    long = GenerationHyperparameters(max_new_tokens=120, greedy=True, ignore_eos=True)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", run(ModelRequest(input_ids=list(PROMPT),
                                                                              gconfig=long))))
    (Path(tmp) / "long-sent").touch()
    t.start()
    deadline = time.monotonic() + 120
    while not (Path(tmp) / "go").exists():  # NOTE: the test saw the request running on the server
        assert time.monotonic() < deadline, "no go from the test"
        time.sleep(0.01)
    engine.pause_generation()
    time.sleep(0.5)
    engine.continue_generation()
    t.join(300)
    result["paused"] = {"tokens": box["r"].output_tokens, "aborted_calls": calls["abort"]}

    engine.set_version(1)  # NOTE: the trainer's side of a disk update: the checkpoint's name, then the call
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=os.path.join(tmp, "names")))
    name_resolve.add(names.update_weights_from_disk(exp, trial, 1), str(time.time()), replace=True)
    engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path=new_dir)).result(timeout=300)
    r = run(ModelRequest(input_ids=list(PROMPT), gconfig=greedy))
    result["after_disk"] = {"tokens": r.output_tokens}
    engine.destroy()
    print(json.dumps(result))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "client":
    _client(sys.argv[2], sys.argv[3], sys.argv[4])
