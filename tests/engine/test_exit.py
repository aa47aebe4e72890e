"""A started manager never keeps the interpreter from exiting, and an idle one sleeps.

Each scenario is a fresh interpreter (`sys.executable -c ...`) that returns from its script without
stopping its manager. Both run at once (a module fixture) to keep the wall time low.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
RUN_TIMEOUT = 120.0  # importing torch + transformers on a loaded 2-core machine is slow
EXIT_LATENCY = 20.0  # from the script's last line to the process being gone (torch teardown alone: ~4 s when loaded)

PRELUDE = textwrap.dedent(
    """
    import json, sys, time
    from support.tiny_models import make_model
    from transformers import GenerationConfig
    from rollout import ContinuousBatchingConfig, init_continuous_batching

    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    manager = init_continuous_batching(make_model("qwen3"), generation_config=gc,
                                       continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=64))
    manager.start()
    assert manager.thread.daemon
    """
)

# a request is being decoded when the script returns
ACTIVE = PRELUDE + textwrap.dedent(
    """
    rid = manager.add_request(list(range(1, 20)), max_new_tokens=1000)
    while rid not in manager.core.requests or not manager.core.requests[rid].generated:
        time.sleep(0.005)
    print(json.dumps({"leaving": time.time()}), flush=True)
    """
)

# idle right after start(), and idle again after one request; then the script returns
IDLE = PRELUDE + textwrap.dedent(
    """
    def idle_cpu(seconds=1.0):
        thread_clock = time.pthread_getcpuclockid(manager.thread.ident)
        p0, t0 = time.process_time(), time.clock_gettime(thread_clock)
        time.sleep(seconds)
        return time.process_time() - p0, time.clock_gettime(thread_clock) - t0

    after_start = idle_cpu()
    rid = manager.add_request(list(range(1, 20)), max_new_tokens=4)
    assert manager.get_result(timeout=60).request_id == rid
    time.sleep(0.3)  # let the math library's worker threads go to sleep after the last forward
    after_request = idle_cpu()
    assert manager.is_running()
    print(json.dumps({"after_start": after_start, "after_request": after_request, "leaving": time.time()}),
          flush=True)
    """
)


def _launch(script: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    procs = {"active": _launch(ACTIVE), "idle": _launch(IDLE)}
    deadline = time.monotonic() + RUN_TIMEOUT
    out: dict[str, dict] = {}
    pending = dict(procs)
    while pending and time.monotonic() < deadline:
        for name, proc in list(pending.items()):
            if proc.poll() is not None:
                ended = time.time()
                stdout, stderr = proc.communicate()
                out[name] = dict(rc=proc.returncode, ended=ended, stdout=stdout, stderr=stderr)
                del pending[name]
        time.sleep(0.02)
    for name, proc in pending.items():  # hung: kill it and report
        proc.kill()
        stdout, stderr = proc.communicate()
        out[name] = dict(rc=None, ended=None, stdout=stdout, stderr=stderr)
    return out


def _report(run: dict) -> dict:
    assert run["rc"] is not None, f"the interpreter did not exit within {RUN_TIMEOUT}s:\n{run['stderr'][-3000:]}"
    assert run["rc"] == 0, f"exit code {run['rc']}:\n{run['stderr'][-3000:]}"
    lines = [line for line in run["stdout"].splitlines() if line.startswith("{")]
    assert lines, f"no report:\n{run['stdout']}\n{run['stderr'][-3000:]}"
    report = json.loads(lines[-1])
    latency = run["ended"] - report["leaving"]
    assert latency < EXIT_LATENCY, f"exit took {latency:.1f}s after the script returned"
    return report


def test_exit_with_an_active_request_and_no_stop(runs):
    _report(runs["active"])


def test_exit_with_an_idle_running_manager(runs):
    _report(runs["idle"])


def test_idle_manager_uses_almost_no_cpu(runs):
    report = _report(runs["idle"])
    for phase in ("after_start", "after_request"):
        process_cpu, loop_thread_cpu = report[phase]
        assert loop_thread_cpu < 0.02, f"{phase}: the engine thread used {loop_thread_cpu:.3f}s CPU in 1s idle"
        assert process_cpu < 0.1, f"{phase}: the process used {process_cpu:.3f}s CPU in 1s idle"
