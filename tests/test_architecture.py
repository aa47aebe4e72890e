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
MAX_LINES = 600


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
        if path == ROOT / "rollout" / "engine" / "manager.py" or path == Path(__file__).resolve():
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


# NOTE: private names of other libraries that share a spelling with one of rollout's (torch's tensor version
# counter is what rollout's weight copies are keyed by).
FOREIGN_PRIVATE = {"_version"}


def _private_names_defined(tree: ast.AST) -> set[str]:
    """The `_single_underscore` names a file defines: functions, classes, assignments, attributes it sets."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            names.add(node.args[1].value)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_uses(files: list[Path]) -> list[str]:
    """Every use, from another file, of a private name a rollout module defines: an attribute read or
    written (`obj._name`, not `self._name`), a `from rollout... import _name`, a `monkeypatch.setattr(x, "_name")`.
    Another module asks a component through its public methods or named hooks, never its underscored state."""
    trees = {p: ast.parse(p.read_text()) for p in files}
    owned = set()
    for path, tree in trees.items():
        if path.is_relative_to(ROOT / "rollout"):
            owned |= _private_names_defined(tree)
    owned -= FOREIGN_PRIVATE
    found = []
    for path, tree in trees.items():
        mine = _private_names_defined(tree)

        def hit(name: str, line: int, path=path, mine=mine) -> None:
            if name in owned and name not in mine:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.append(f"{where}:{line}: {name}")

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                hit(node.attr, node.lineno)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollout"):
                for alias in node.names:
                    hit(alias.name, node.lineno)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("setattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                hit(node.args[1].value, node.lineno)
    return found


def test_no_module_uses_another_modules_private_names():
    files = _python_files("rollout", "trainers", "recipes", "benchmarks", "tests")
    offenders = private_uses(files)
    assert not offenders, "private names used from outside their module:\n" + "\n".join(offenders)


def test_the_private_name_check_sees_each_kind_of_use(tmp_path):
    """The check itself: an attribute, an import and a monkeypatch of a rollout-private name are each caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("from rollout.kernels.linear import _weight_copy\n"
                     "def f(pool, monkeypatch, m):\n"
                     "    assert m._destroyed\n"
                     "    monkeypatch.setattr(m, '_lock', None)\n")
    found = private_uses(_python_files("rollout") + [probe])
    assert sorted(f.rsplit(": ", 1)[1] for f in found) == ["_destroyed", "_lock", "_weight_copy"], found


def test_the_folders_are_the_layers():
    """rollout/ is sub-packages by layer: a short top level (entry points and the base every layer uses), and
    every sub-package named in the import-linter layers contract, so no folder escapes the check."""
    import tomllib

    top = sorted(p.name for p in (ROOT / "rollout").glob("*.py"))
    packages = sorted(p.name for p in (ROOT / "rollout").iterdir() if (p / "__init__.py").exists())
    assert len(top) <= 12, top
    assert len(packages) >= 6, packages
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["id"] == "rollout-layers"]
    named = {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}
    assert set(packages) <= named, f"folders outside the layers contract: {sorted(set(packages) - named)}"
    assert {p.removesuffix(".py") for p in top} - {"__init__"} <= named, "a top-level module outside the contract"
