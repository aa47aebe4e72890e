"""ARCHITECTURE.md names every module of `rollout/` and `trainers/`, each once, in its layer's table.

The map's tables have one row per module (or a few modules of one folder in one row): the first cell holds
the paths, `rollout/api/engine.py`, and a package is its folder, `rollout/api/` (or its `__init__.py`).
Each `### ` heading of the `rollout/` map names, in backticks, the top-level folders and modules of one
layer of the `rollout-layers` contract in pyproject.toml, in the contract's order. A new module fails
`test_every_module_has_a_row` with the row to add and the heading of the table to add it to; a row for a
module that is gone fails `test_every_named_path_exists_once_in_its_layer`.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "trainers")
PACKAGE_ROW = "__init__"  # NOTE: the key of `rollout/__init__.py`, which sits in no layer: its own table
ROW_PATHS = re.compile(r"^`[^`]+`(?:,\s*`[^`]+`)*$")
NAMED_PATH = re.compile(r"`((?:rollout|trainers)/[^`\s]*)`")


@dataclass(frozen=True)
class Row:
    path: str  # "rollout/api/engine.py", or "rollout/api/" for rollout/api/__init__.py
    line: int
    heading: str


@dataclass(frozen=True)
class Heading:
    text: str
    line: int
    names: frozenset[str]  # the backticked top-level names, `api`, `__main__`, `trainers`


def module_paths(root: Path) -> list[str]:
    """Every module under the packages as the map spells it: a package's `__init__.py` is its folder."""
    paths = []
    for package in PACKAGES:
        for p in sorted((root / package).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            paths.append(rel[: -len("__init__.py")] if p.name == "__init__.py" else rel)
    return paths


def _folder_form(path: str) -> str:
    """`rollout/api/__init__.py` and `rollout/api/` are the same row."""
    return path.removesuffix("__init__.py") if path.endswith("/__init__.py") else path


def top_name(path: str) -> str:
    """The key of a map path: the top-level folder or module under rollout/ (its layer), or `trainers`."""
    package, _, rest = path.partition("/")
    if package == "trainers":
        return "trainers"
    if not rest:
        return PACKAGE_ROW
    return rest.split("/")[0].removesuffix(".py")


def rollout_layers(root: Path) -> list[frozenset[str]]:
    config = tomllib.loads((root / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c.get("id") == "rollout-layers"]
    return [frozenset(n.strip() for n in layer.split("|")) for layer in layers]


def parse_map(text: str) -> tuple[list[Heading], list[Row]]:
    """The headings that name layers (backticked identifiers), the table rows whose first cell is paths."""
    headings, rows = [], []
    heading = ""
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("## ") or line.startswith("### "):
            heading = line.strip()
            names = frozenset(re.findall(r"`(\w+)`", line))
            if names:
                headings.append(Heading(heading, i, names))
        elif line.startswith("|"):
            first = line.strip("|").split("|")[0].strip()
            if ROW_PATHS.match(first) and NAMED_PATH.search(first):
                rows.extend(Row(_folder_form(p), i, heading) for p in re.findall(r"`([^`]+)`", first))
    return headings, rows


def layer_heading_problems(root: Path, headings: list[Heading]) -> list[str]:
    """One heading per layer of the contract (plus the package and trainers/), in the contract's order."""
    wanted = [frozenset({PACKAGE_ROW}), *rollout_layers(root), frozenset({"trainers"})]
    problems, order = [], []
    for names in wanted:
        match = [h for h in headings if h.names == names]
        spelled = ", ".join(f"`{n}`" for n in sorted(names))
        if len(match) == 1:
            order.append(match[0].line)
            continue
        if match:
            problems.append(f"ARCHITECTURE.md has {len(match)} headings naming {spelled} (lines "
                            f"{', '.join(str(h.line) for h in match)}): one table per layer")
            continue
        near = max(headings, key=lambda h: len(h.names & names), default=None)
        hint = ""
        if near is not None and near.names & names:
            missing = ", ".join(f"`{n}`" for n in sorted(names - near.names)) or "nothing"
            extra = ", ".join(f"`{n}`" for n in sorted(near.names - names)) or "nothing"
            hint = (f"; the nearest is '{near.text}' (line {near.line}): add {missing} to it, remove {extra} "
                    f"(or move those names to their own layer's heading)")
        problems.append(f"no heading of ARCHITECTURE.md names exactly the layer {spelled} of the "
                        f"`rollout-layers` contract in pyproject.toml{hint}")
    if not problems and order != sorted(order):
        problems.append("ARCHITECTURE.md's layer headings are not in the order of the `rollout-layers` "
                        "contract in pyproject.toml (top to bottom)")
    return problems


def missing_row_problems(root: Path, headings: list[Heading], rows: list[Row]) -> list[str]:
    named = {r.path for r in rows}
    where = {n: h for h in headings for n in h.names}
    problems = []
    for path in module_paths(root):
        if path in named:
            continue
        key = top_name(path)
        module = path + "__init__.py" if path.endswith("/") else path
        row = f"| `{path}` | what it owns |"
        if key in where:
            h = where[key]
            problems.append(f"{module} has no row in ARCHITECTURE.md: add `{row}` to the table under "
                            f"'{h.text}' (line {h.line})")
        else:
            problems.append(f"{module} has no row in ARCHITECTURE.md, and `{key}` is in no layer: add "
                            f"`{key}` to the layer it belongs to in the `rollout-layers` contract of "
                            f"pyproject.toml and to that layer's heading in ARCHITECTURE.md, then add "
                            f"`{row}` to its table")
    return problems


def row_problems(root: Path, headings: list[Heading], rows: list[Row]) -> list[str]:
    """Rows naming modules that do not exist, named twice, or in another layer's table."""
    modules = set(module_paths(root))
    where = {n: h for h in headings for n in h.names}
    problems, seen = [], {}
    for r in rows:
        if r.path not in modules:
            kind = "a package without __init__.py" if (root / r.path).is_dir() else "no module"
            problems.append(f"ARCHITECTURE.md:{r.line} names `{r.path}`, {kind}: fix the path or remove "
                            f"the row")
            continue
        if r.path in seen:
            problems.append(f"ARCHITECTURE.md:{r.line} names `{r.path}` again (first on line "
                            f"{seen[r.path]}): keep one row")
        seen.setdefault(r.path, r.line)
        home = where.get(top_name(r.path))
        if home is not None and home.text != r.heading:
            problems.append(f"ARCHITECTURE.md:{r.line} has `{r.path}` under '{r.heading}': move the row to "
                            f"'{home.text}' (line {home.line}), its layer's table")
    return problems


def stale_path_problems(root: Path, text: str, rows: list[Row]) -> list[str]:
    """Any other backticked `rollout/...` or `trainers/...` path in the text must exist too."""
    problems, row_lines = [], {r.line for r in rows}
    for i, line in enumerate(text.splitlines(), 1):
        cells = line.strip("|").split("|")[1:] if i in row_lines else [line]  # the rows' paths: row_problems
        for path in NAMED_PATH.findall("|".join(cells)):
            if not (root / path).exists():
                problems.append(f"ARCHITECTURE.md:{i} names `{path}`, which does not exist")
    return problems


def all_problems(root: Path) -> list[str]:
    text = (root / "ARCHITECTURE.md").read_text()
    headings, rows = parse_map(text)
    return (layer_heading_problems(root, headings) + missing_row_problems(root, headings, rows)
            + row_problems(root, headings, rows) + stale_path_problems(root, text, rows))


def test_layer_headings_follow_the_import_contract():
    headings, _ = parse_map((ROOT / "ARCHITECTURE.md").read_text())
    problems = layer_heading_problems(ROOT, headings)
    assert not problems, "\n".join(problems)


def test_every_module_has_a_row():
    headings, rows = parse_map((ROOT / "ARCHITECTURE.md").read_text())
    problems = missing_row_problems(ROOT, headings, rows)
    assert not problems, "\n".join(problems)


def test_every_named_path_exists_once_in_its_layer():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    headings, rows = parse_map(text)
    problems = row_problems(ROOT, headings, rows) + stale_path_problems(ROOT, text, rows)
    assert not problems, "\n".join(problems)


# The checker itself, on a scratch tree: the real map and contract over empty copies of the real modules.


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "ARCHITECTURE.md", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for package in PACKAGES:
        for p in (ROOT / package).rglob("*.py"):
            dst = tmp_path / p.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.touch()
    for path in NAMED_PATH.findall((ROOT / "ARCHITECTURE.md").read_text()):  # folders the prose names
        if (ROOT / path).is_dir():
            (tmp_path / path).mkdir(parents=True, exist_ok=True)
    assert all_problems(tmp_path) == []
    return tmp_path


def _edit(root: Path, old: str, new: str) -> None:
    text = (root / "ARCHITECTURE.md").read_text()
    assert old in text
    (root / "ARCHITECTURE.md").write_text(text.replace(old, new, 1))


def test_checker_names_a_new_module_and_its_table(scratch):
    (scratch / "rollout/serve/example_routes.py").touch()
    (problem,) = all_problems(scratch)
    assert problem.startswith("rollout/serve/example_routes.py has no row")
    assert "| `rollout/serve/example_routes.py` | what it owns |" in problem
    assert "'### Entry points: `serve`, `integrations`, `agents`, `client`, `tinker`'" in problem


def test_checker_names_a_new_folder_outside_the_layers(scratch):
    (scratch / "rollout/newpkg").mkdir()
    (scratch / "rollout/newpkg/__init__.py").touch()
    (problem,) = all_problems(scratch)
    assert problem.startswith("rollout/newpkg/__init__.py has no row")
    assert "`newpkg` is in no layer" in problem and "pyproject.toml" in problem


def test_checker_names_a_layer_its_heading_lacks(scratch):
    toml = (scratch / "pyproject.toml").read_text()
    (scratch / "pyproject.toml").write_text(toml.replace('"api",', '"api | newpkg",', 1))
    problems = all_problems(scratch)
    assert any("`api`, `newpkg`" in p and "add `newpkg`" in p for p in problems), problems


def test_checker_names_a_row_of_a_module_that_is_gone(scratch):
    (scratch / "rollout/api/score_batch.py").unlink()
    problems = all_problems(scratch)
    assert any(p.startswith("ARCHITECTURE.md:") and "`rollout/api/score_batch.py`, no module" in p
               for p in problems), problems


def test_checker_names_a_duplicated_and_a_misplaced_row(scratch):
    row = "| `rollout/engine/core.py` |"
    _edit(scratch, "| `rollout/kv/page_pool.py` |", f"{row} again |\n| `rollout/kv/page_pool.py` |")
    problems = all_problems(scratch)
    assert any("`rollout/engine/core.py` again" in p for p in problems), problems
    assert any("move the row to '### Engine loop: `engine`'" in p for p in problems), problems


def test_checker_names_a_missing_row_and_a_stale_prose_path(scratch):
    _edit(scratch, "| `rollout/kv/offload.py` | CPU offload of preempted pages |\n", "")
    _edit(scratch, "(`rollout/model/runner.py`)", "(`rollout/model/runners.py`)")
    problems = all_problems(scratch)
    assert any(p.startswith("rollout/kv/offload.py has no row") and "'### Memory, weights" in p
               for p in problems), problems
    assert any("`rollout/model/runners.py`, which does not exist" in p for p in problems), problems
