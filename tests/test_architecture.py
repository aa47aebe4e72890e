"""The structure as a checked contract: import layers, no private manager state used from outside, small
modules that say what they own. See ARCHITECTURE.md."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


def test_import_layers_hold():
    """`lint-imports` (import-linter; contracts in pyproject.toml): rollout/'s layers, no cycles, rollout
    never imports trainers, the pure-Python core imports no torch."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.skip("import-linter is not installed (it is in the [dev] extra)")
    proc = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and "KEPT" in proc.stdout


def test_rollout_never_imports_recipes():
    """recipes/ are scripts, not a package: an import of them from the engine would only work from a checkout."""
    for path in _python_files("rollout", "trainers"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            assert not any(n == "recipes" or n.startswith("recipes.") for n in names), f"{path} imports {names}"


# NOTE: what the check greps for: the manager's underscored state, its old core accessor, the
# engine's old private seed helper. Only manager.py may touch the first two.
PRIVATE = re.compile(r"manager\._|\._core\(\)|_row_seed")


@pytest.mark.parametrize("folder", ["rollout", "benchmarks", "recipes", "trainers", "tests"])
def test_no_private_manager_state_outside_manager(folder):
    offenders = []
    for path in _python_files(folder):
        if path == ROOT / "rollout" / "manager.py" or path == Path(__file__).resolve():
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("folder", ["rollout", "trainers"])
def test_modules_are_small_and_say_what_they_own(folder):
    for path in _python_files(folder):
        text = path.read_text()
        lines = text.count("\n")
        assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (split it: one concept per file)"
        if text.strip():
            assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)} opens without a docstring"
