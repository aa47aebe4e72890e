"""`benchmarks/device_check.sh --dry-run` runs on a CPU (CI) and says what it would measure on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_dry_run_writes_its_plan_and_a_tiny_measurement(tmp_path):
    out = tmp_path / "device_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_check.sh"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "would measure:" in p.stdout
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["environment"]["cuda"] is False
    assert any("gpu tests" in line for line in result["plan"]) and any("0.6B" in line for line in result["plan"])
    # the gpu tests were collected, not run (returncode 0: collected; the module is there and imports)
    assert result["gpu_tests"]["returncode"] == 0 and "--collect-only" in result["gpu_tests"]["command"]
    log = (tmp_path / "device_check_tests.log").read_text()
    assert "test_gpu.py" in log and "test_rl_loop_on_cuda_update_sleep_wake_close" in log
    systems = result["throughput"]["systems"]
    assert set(systems) == {"ours_sdpa", "generate", "hf_cb"}
    for name, entry in systems.items():
        assert "error" not in entry, (name, entry)
        assert entry["tokens_per_s"] > 0 and entry["greedy_exact_vs_generate"] == 1.0
    assert "test_triton_invariant.py" in log  # NOTE: the GPU path of the batch-invariant mode, compiled there
    inv = result["invariant_overhead"]  # NOTE: on a CPU the mode's C++ kernels against the CPU default
    assert set(inv["systems"]) == {"invariant", "default"} and "slowdown_vs_default" in inv
    assert all(e["tokens_per_s"] > 0 for e in inv["systems"].values()), inv
    assert inv["request0_alone_equals_batch"] == {"tokens": True, "logprobs": True}
    prof = result["step_profile"]
    assert "error" not in prof, prof
    assert prof["rows"] == 4 and prof["wall_ms_per_step"] > 0 and prof["top_cpu_ops"]
