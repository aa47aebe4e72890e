"""Disaggregated rollout: 2 `rollout serve` child processes + this process as the learner (`RolloutPool`,
`WeightBroadcaster`, `ServerProcesses`). One broadcast per update reaches both servers (versions bumped on
both, greedy outputs of each equal HF `generate` on the new weights, logprobs equal a teacher-forced forward);
a server killed mid-call: the call finishes on the other, says so in the log, and later updates go to the
survivor only. Servers bind 127.0.0.1 on free ports and are stopped by the fixture."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod, reason=f"disaggregated rollout tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
from support.serving import save_tiny  # noqa: E402
from support.tiny_models import hf_greedy, make_model  # noqa: E402

from rollout.fleet.pool import RolloutPool  # noqa: E402
from rollout.fleet.server_procs import ServerProcesses  # noqa: E402
from rollout.weights.transfer import buckets, unflatten  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]

KEY = "disagg-key"
PROMPTS = [[7, 30, 41, 9, 77, 12], [5, 66, 90, 3], [21, 54, 18, 33, 71]]
SERVE_ARGS = ["--api-key", KEY, "--page-size", "16", "--num-blocks", "256", "--dtype", "float32",
              "--log-level", "warning"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model_dir = save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    with ServerProcesses(str(model_dir), n=2, threads=1, serve_args=SERVE_ARGS,
                         log_dir=str(tmp_path_factory.mktemp("logs")), start_timeout_s=180) as procs:
        yield procs
    assert all(p.poll() is not None for p in procs.procs)  # stopped: no orphan server


def get(url: str, path: str) -> dict:
    return httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()


def greedy_on(url: str, prompt: list[int], n: int = 8) -> list[int]:
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    # the weights that answered, named by the response itself
    assert int(r.headers["x-weight-version"]) == get(url, "/get_weight_version")["weight_version"]
    return r.json()["choices"][0]["token_ids"]


@torch.no_grad()
def teacher_forced(model, prompt: list[int], completion: list[int]) -> torch.Tensor:  # [T]
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_buckets_round_trip_by_dtype_and_size():
    a, b, c = torch.randn(3, 4), torch.randn(10), torch.arange(6, dtype=torch.int64).view(2, 3)
    tied = [("x", a), ("y", b), ("i", c), ("x_tied", a), ("z", torch.randn(2, 2))]
    out = list(buckets(tied, bucket_bytes=4 * 14))  # a (12 floats) + b (10) overflow: b starts a new bucket
    assert [[n for n, _ in bk] for bk in out] == [["x"], ["y", "z"], ["i"]]  # tied x_tied sent once
    for bk in out:
        assert len({t.dtype for _, t in bk}) == 1  # a bucket is one flat buffer: one dtype
        views = unflatten(torch.cat([t.reshape(-1) for _, t in bk]), [list(t.shape) for _, t in bk])
        assert all(torch.equal(v, t) for v, (_, t) in zip(views, bk, strict=True))


def test_one_broadcast_reaches_both_servers(servers):
    v0 = [get(u, "/get_weight_version")["weight_version"] for u in servers.urls]
    new = make_model("qwen3", seed=5)
    with RolloutPool(servers.urls, api_key=KEY, request_timeout_s=120) as pool:
        calls = []
        pool.sync.init()
        real = pool.sync.group.broadcast
        pool.sync.group = _Counting(pool.sync.group, calls)
        version = pool.update_weights(new)
        assert real is not None and len(calls) == 1  # the tiny model is one fp32 bucket: ONE broadcast
        assert [get(u, "/get_weight_version")["weight_version"] for u in servers.urls] == [v + 1 for v in v0]
        assert version == v0[0] + 1 == pool.policy_version
        for url in servers.urls:  # each server now serves exactly the new weights
            for prompt in PROMPTS:
                assert greedy_on(url, prompt) == hf_greedy(new, prompt, 8)
        # the pool's batches: token ids and logprobs straight from the servers, no retokenisation
        batch = pool.generate(PROMPTS, temps=1.0, group_size=4, max_new_tokens=6, seed=3)
        assert batch.completion_ids.shape[0] == len(PROMPTS) * 4 and batch.policy_version == version
        for row in range(len(batch)):
            prompt = PROMPTS[row // 4]
            k = int(batch.completion_mask[row].sum())
            completion = batch.completion_ids[row, :k].tolist()
            want = teacher_forced(new, prompt, completion)
            torch.testing.assert_close(batch.logprobs[row, :k], want, atol=2e-4, rtol=0)
            # per-token versions come from the servers' `weight_versions` (0 on padding)
            assert batch.versions[row, :k].tolist() == [version] * k and not batch.versions[row, k:].any()
        again = pool.generate(PROMPTS, temps=1.0, group_size=4, max_new_tokens=6, seed=3)
        assert torch.equal(again.completion_ids, batch.completion_ids)  # seeded per group, any server


def test_pool_outputs_carry_the_servers_per_token_versions():
    """A choice that spans an in-flight update (weight_versions [3, 3, 4]) keeps both versions per token;
    a length mismatch is an error, not a silent truncation."""
    choice = {"index": 0, "token_ids": [5, 6, 7], "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]},
              "finish_reason": "length", "weight_versions": [3, 3, 4]}
    (out,) = RolloutPool.outputs_from_answer(0, [1, 2], 1, {"choices": [choice]}, 9)
    assert out.versions == [3, 3, 4] and out.policy_version == 3
    with pytest.raises(RuntimeError, match="weight versions"):
        RolloutPool.outputs_from_answer(0, [1, 2], 1, {"choices": [{**choice, "weight_versions": [3]}]}, 9)
    (old,) = RolloutPool.outputs_from_answer(0, [1, 2], 1, {"choices": [{k: v for k, v in choice.items()
                                                               if k != "weight_versions"}]}, 9)
    assert old.versions is None and old.policy_version == 9  # a server without per-token versions


def test_bad_weight_group_requests_are_refused_by_name(servers):
    def init(**info):
        return httpx.post(servers.urls[0] + "/init_weight_transfer_engine", headers={"Authorization": f"Bearer {KEY}"},
                          json={"init_info": {"master_address": "127.0.0.1", "master_port": 1, **info}}, timeout=30)

    r = init(backend="nccl", rank_offset=1, world_size=3)
    assert r.status_code == 400 and "nccl" in r.json()["error"]["message"]
    r = init(rank_offset=3, world_size=3)
    assert r.status_code == 400 and "rank_offset 3" in r.json()["error"]["message"]
    if not torch.cuda.is_available():
        from rollout.weights.broadcast import WeightBroadcaster

        with pytest.raises(ValueError, match="nccl"):
            WeightBroadcaster(servers.urls, backend="nccl")


class _Counting:
    """The group with its `broadcast` calls counted."""

    def __init__(self, group, calls: list) -> None:
        self.group, self.calls = group, calls

    def broadcast(self, tensor, root):
        self.calls.append(tensor.numel())
        return self.group.broadcast(tensor, root)


def test_disk_fallback_updates_every_server(servers, tmp_path):
    v0 = [get(u, "/get_weight_version")["weight_version"] for u in servers.urls]
    new = make_model("qwen3", seed=7)
    with RolloutPool(servers.urls, api_key=KEY, weight_transfer="disk", disk_dir=str(tmp_path / "w")) as pool:
        assert pool.update_weights(new) == v0[0] + 1
    assert [get(u, "/get_weight_version")["weight_version"] for u in servers.urls] == [v + 1 for v in v0]
    for url in servers.urls:
        assert greedy_on(url, PROMPTS[1]) == hf_greedy(new, PROMPTS[1], 8)


class _HungServer:
    """A server on 127.0.0.1 that answers its version, then hangs (a stuck process): every later request,
    /health included, gets no answer until the test ends."""

    def __init__(self) -> None:
        import http.server

        release = self.release = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/get_weight_version":
                    body = b'{"weight_version": 0}'
                    self.send_response(200)
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    release.wait(60)

            def do_POST(self):
                release.wait(60)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_hung_server_is_dropped_at_the_request_deadline(servers, caplog):
    hung = _HungServer()
    prompts = PROMPTS * 2
    try:
        with RolloutPool([servers.urls[0]], api_key=KEY) as alone:
            want = alone.generate(prompts, temps=1.0, group_size=2, max_new_tokens=8, seed=5)
        with RolloutPool([hung.url, servers.urls[0]], api_key=KEY, request_timeout_s=3, health_timeout_s=1) as pool:
            start = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="rollout.fleet.pool"):
                got = pool.generate(prompts, temps=1.0, group_size=2, max_new_tokens=8, seed=5)
            # one deadline, one probe: far from an infinite wait
            assert time.monotonic() - start < 30
            assert pool.alive == [servers.urls[0]] and 1 <= pool.resubmitted <= len(prompts)
        down = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
        assert len(down) == 1 and hung.url in down[0] and "ReadTimeout" in down[0], down
        assert torch.equal(got.completion_ids, want.completion_ids)
    finally:
        hung.close()


def test_killing_a_server_mid_call_finishes_on_the_other(servers, caplog):
    # NOTE: last in the module: it kills one of the module's servers.
    prompts = [[(7 * i + j) % 100 + 10 for j in range(6)] for i in range(12)]
    with RolloutPool(servers.urls, api_key=KEY, request_timeout_s=120) as pool:
        want = pool.generate(prompts, temps=1.0, group_size=2, max_new_tokens=24, seed=11)
        box: dict = {}
        with caplog.at_level(logging.WARNING, logger="rollout.fleet.pool"):
            t = threading.Thread(target=lambda: box.setdefault("batch", pool.generate(
                prompts, temps=1.0, group_size=2, max_new_tokens=24, seed=11)), daemon=True)
            t.start()
            deadline = time.monotonic() + 60
            while pool.in_flight[servers.urls[1]] == 0:  # until server 1 holds groups
                assert t.is_alive() and time.monotonic() < deadline, "server 1 never got a group"
                time.sleep(0.005)
            servers.kill(1)
            t.join(180)
            assert not t.is_alive(), "the call did not finish on the surviving server"
        down = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
        assert len(down) == 1 and servers.urls[1] in down[0] and servers.urls[0] in down[0], down
        assert pool.alive == [servers.urls[0]] and pool.resubmitted >= 1
        got = box["batch"]  # every group, and the same samples: seeds follow the group, not the server
        assert torch.equal(got.completion_ids, want.completion_ids)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
        # the next update rebuilds the group over the survivor only
        v = get(servers.urls[0], "/get_weight_version")["weight_version"]
        new = make_model("qwen3", seed=9)
        assert pool.update_weights(new) == v + 1 and pool.sync.members == [servers.urls[0]]
        assert greedy_on(servers.urls[0], PROMPTS[0]) == hf_greedy(new, PROMPTS[0], 8)


@pytest.mark.slow  # NOTE: 3 more Python processes to start: ~25 s on a calm box, 35-70 s at load 8-12
def test_recipe_survives_a_dead_server_and_ctrl_c_leaves_no_orphan(tmp_path):
    """`recipes/grpo_disagg.py` in one command: 2 servers started as children, GRPO steps whose rollouts come
    from them and whose weights reach them (the servers' logprobs equal the learner's on every step: the
    broadcast landed); server 1 killed after step 3: the run goes on with server 0 and says so; then Ctrl-C:
    the learner exits and no server is left."""
    from support.training import save_tiny_addition_checkpoint

    model = save_tiny_addition_checkpoint(tmp_path / "model")
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "grpo_disagg.py"), "--model", model, "--rollout_servers", "2",
           "--steps", "1000", "--prompts_per_step", "4", "--group_size", "4", "--output_dir", str(out),
           "--server_cpus", "0", "--learner_cpus", "0"]  # NOTE: given, so the test process's cores stay as they are
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "learner.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    metrics = out / "metrics.jsonl"

    def wait_steps(n: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {n} steps in {timeout} s: {log.read_text()[-3000:]}"
            time.sleep(0.1)

    try:
        wait_steps(3)
        pids = [int((out / "servers" / f"server{i}.pid").read_text()) for i in range(2)]
        assert all(_alive(p) for p in pids)
        assert all(os.sched_getaffinity(p) == {0} for p in pids)  # --server_cpus 0
        os.killpg(pids[1], signal.SIGKILL)  # server 1 dies mid-run
        wait_steps(7)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records[:7]] == list(range(1, 8))
    assert [r["policy_version"] for r in records[:7]] == [float(v) for v in range(7)]
    # the learner's logprobs of the servers' tokens, under the weights it broadcast, equal the servers' own
    assert all(r["logprob_mismatch_max"] < 1e-4 for r in records), [r["logprob_mismatch_max"] for r in records]
    text = log.read_text()
    assert "weights broadcast to 2 server(s)" in text and "weights broadcast to 1 server(s)" in text
    down = [line for line in text.splitlines() if "is down" in line]
    assert len(down) == 1 and f"127.0.0.1:{_port(out, 1)} is down" in down[0], down
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"orphan rollout server(s) after Ctrl-C: {[p for p in pids if _alive(p)]}"
        time.sleep(0.1)


@pytest.mark.slow  # NOTE: a learner process and its server to start: ~15 s calm
def test_servers_die_with_a_learner_killed_outright(tmp_path):
    """SIGKILL on the learner runs none of its cleanup; the kernel still stops its servers (PR_SET_PDEATHSIG)."""
    model = save_tiny(tmp_path / "model")
    script = (f"import sys; from rollout.fleet.server_procs import ServerProcesses\n"
              f"s = ServerProcesses({str(model)!r}, n=1, serve_args=['--log-level', 'warning'], "
              f"log_dir={str(tmp_path / 'logs')!r}, start_timeout_s=170)\n"
              "print('UP', flush=True); sys.stdin.read()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    learner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               env=env, cwd=ROOT, text=True)
    try:
        assert learner.stdout.readline().strip() == "UP"
        pid = int((tmp_path / "logs" / "server0.pid").read_text())
        assert _alive(pid)
        learner.kill()
        learner.wait(30)
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, "the server outlived its SIGKILLed learner"
            time.sleep(0.1)
    finally:
        if learner.poll() is None:
            learner.kill()


def _port(out: Path, i: int) -> int:
    """Server i's port, from its command line in the learner's log of started servers."""
    log = (out.parent / "learner.log").read_text()
    urls = log.split("rollout server(s) up: ")[1].split(" (logs")[0].split(", ")
    return int(urls[i].rsplit(":", 1)[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # NOTE: a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
