"""The style ruff checks (`[tool.ruff]` in pyproject.toml: pycodestyle, pyflakes, imports, pyupgrade, bugbear,
lines up to the configured length) holds over the code: `ruff check` finds nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["rollout", "trainers", "recipes", "benchmarks", "tests"]


def _ruff() -> str:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.skip("ruff is not installed (it is in the [dev] extra)")
    return exe


def test_line_length_is_enforced():
    """E501 is not ignored: the configured line length is a rule, not a suggestion."""
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert lint["line-length"] == 120
    ignored = lint.get("lint", {}).get("ignore", []) + lint.get("ignore", [])
    assert "E501" not in ignored and "E" in lint["lint"]["select"]


def test_ruff_finds_nothing():
    proc = subprocess.run([_ruff(), "check", "--output-format", "concise", *FOLDERS], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"ruff check (fix, or wrap lines at 120):\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
