"""Data-parallel GRPO on two CPU ranks (gloo) through `accelerate launch`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "ddp_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_stay_identical_while_rolling_out_different_prompts(tmp_path):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(WORKER),
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    zero, one = ranks[0]["records"], ranks[1]["records"]
    assert [r["step"] for r in zero] == [r["step"] for r in one] == [0, 1, 2, 3]
    # Built from different seeds, DDP's broadcast makes the ranks equal before the first step ...
    assert zero[0]["hash"] == one[0]["hash"]
    for a, b in zip(zero[1:], one[1:], strict=True):
        # ... each rank rolls out its own shard, and all-reduced gradients keep them equal after.
        assert set(a["prompts"]).isdisjoint(b["prompts"]), "both ranks rolled out the same prompts"
        assert a["hash"] == b["hash"], f"parameters differ across ranks after step {a['step']}"
        assert a["metrics"] == b["metrics"], "metrics must be reduced across ranks"
        assert a["metrics"]["logprob_mismatch_max"] <= 1e-4
    hashes = [r["hash"] for r in zero]
    assert len(set(hashes)) == len(hashes), "a step left the parameters unchanged"
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # the main process logs once
