"""A recipe's refusal is one line under `accelerate launch` too (issue 62): accelerate answers a child's non-zero
exit with a `CalledProcessError` traceback of its own, so `_common.refuse` stops the launcher first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))  # NOTE: recipes import their sibling `_common`, as they do when launched

import _common  # noqa: E402

ACCELERATE = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")


def test_refuse_prints_one_line_and_exits_2_without_signalling_a_parent_that_is_no_launcher(capsys):
    refusal = _common.refuse("recipes/x.py: refusing to write into runs/y: it holds the results of recipes/z.py.")
    assert isinstance(refusal, SystemExit) and refusal.code == 2
    assert str(refusal) == "recipes/x.py: refusing to write into runs/y: it holds the results of recipes/z.py."
    assert capsys.readouterr().err == str(refusal) + "\n"
    assert not _common._accelerate_launcher(os.getppid()) and not _common._accelerate_launcher(os.getpid())


def _launch(tmp_path: Path, config: str, *flags: str) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file recipes/accelerate/CONFIG recipes/grpo.py --output_dir runs/x FLAGS` in a
    folder where `runs/x` holds another recipe's results."""
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / _common.RUN_FILE).write_text(json.dumps({"recipe": "recipes/ppo.py", "flags": {}}))
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([ACCELERATE, "launch", "--config_file", f"recipes/accelerate/{config}", "recipes/grpo.py",
                           "--output_dir", "runs/x", *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.skipif(ACCELERATE is None, reason="accelerate is not installed (the recipes' launcher)")
def test_a_refused_output_dir_is_one_line_under_accelerate_launch(tmp_path):
    done = _launch(tmp_path, "local.yaml")
    assert done.returncode != 0  # NOTE: 143: the launcher stopped on the refusal's signal
    assert done.stderr.splitlines() == [
        "recipes/grpo.py: refusing to write into runs/x: it holds the results of recipes/ppo.py. Choose another "
        "--output_dir, or pass --overwrite to replace those results."], done.stderr
    assert "Traceback" not in done.stdout + done.stderr and not (tmp_path / "runs" / "x" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(ACCELERATE is None, reason="accelerate is not installed (the recipes' launcher)")
def test_a_refusal_on_two_ranks_is_one_line_of_ours_and_no_traceback(tmp_path):
    done = _launch(tmp_path, "2cpu.yaml", "--tp_size", "3")
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if "death signal" not in line and "closing signal" not in line]
    assert len(ours) == 1, done.stderr
    assert ours[0].startswith("recipes/grpo.py: --tp_size 3 does not divide the world size 2: launch a multiple of 3")
    assert "Traceback" not in done.stdout + done.stderr
