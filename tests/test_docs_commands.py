"""The README's and the docs' recipe commands parse as written and never write the same output directory with
different runs (issue 62: the fleet and async commands of the docs overwrote the demo's `runs/grpo`); every
`rollout serve DIR/final` they show serves what one of them writes. Running them: `tests/support/doc_commands.py`."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
from support.doc_commands import ROOT, commands

RECIPES = ROOT / "recipes"
sys.path.insert(0, str(RECIPES))  # NOTE: recipes import their sibling `_common`, as they do when launched


def recipe_module(path: str):
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(f"docs_recipe_{name}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launched() -> list[tuple[object, object]]:
    """(command, its parsed recipe args) for every documented recipe command."""
    out, modules = [], {}
    for command in commands():
        if command.recipe is None:
            continue
        module = modules.setdefault(command.recipe, recipe_module(command.recipe))
        try:
            args = module.parse_args(command.recipe_argv)
        except SystemExit:
            pytest.fail(f"{command}\n  {command.recipe} does not take these flags")
        out.append((command, args))
    return out


def test_the_docs_have_the_commands_this_test_reads():
    found = {c.doc for c in commands()}
    assert {"README.md", "docs/recipes.md", "docs/lora.md", "docs/fleets.md", "docs/launching.md"} <= found
    assert sum(c.recipe is not None for c in commands()) >= 15


def test_every_recipe_command_parses_and_names_files_that_exist():
    for command, _ in launched():
        words = command.words
        if "--config_file" in words:
            assert (ROOT / words[words.index("--config_file") + 1]).is_file(), str(command)
        for flag in ("--dataset",):
            if flag in words and words[words.index(flag) + 1].startswith("tests/"):
                assert (ROOT / words[words.index(flag) + 1]).exists(), str(command)


def test_no_two_documented_runs_share_an_output_directory():
    """What the recipes refuse at run time (`_common.claim_output_dir`), checked over the docs in reading order:
    a directory is written by one run only (the same command repeated in two docs is one run)."""
    import _common

    owners: dict[str, tuple[dict, object]] = {}
    clashes = []
    for command, args in launched():
        if getattr(args, "resume_from_checkpoint", None):
            continue
        record = _common.run_record(command.recipe, args)
        out = str(Path(args.output_dir))
        if out in owners and owners[out][0] != record:
            clashes.append(f"{owners[out][1]}\n    and {command}\n    both write {out}")
        owners.setdefault(out, (record, command))
    assert not clashes, "documented commands that overwrite each other:\n  " + "\n  ".join(clashes)


def test_served_checkpoints_are_ones_a_documented_command_writes():
    outputs = {str(Path(args.output_dir)) for _, args in launched()}
    for command in commands():
        words = command.words
        if words[:2] == [".venv/bin/rollout", "serve"] and words[2] != "BASE_DIR":
            assert str(Path(words[2]).parent) in outputs, f"{command}: no documented command writes {words[2]}"


def test_the_command_reader_joins_continuations_and_drops_comments(tmp_path):
    (tmp_path / "doc.md").write_text(
        "text `.venv/bin/python recipes/grpo.py\n--steps 2` more\n"
        "```bash\n# a comment\n.venv/bin/accelerate launch recipes/ppo.py \\\n    --steps 3   # 'why'\n```\n")
    found = commands(["doc.md"], tmp_path)
    assert [(c.line, c.text) for c in found] == [
        (1, ".venv/bin/python recipes/grpo.py --steps 2"),
        (5, ".venv/bin/accelerate launch recipes/ppo.py --steps 3"),
    ]
    assert found[1].recipe == "recipes/ppo.py" and found[1].recipe_argv == ["--steps", "3"]


# ------------------------------------------------------------------ the figures the docs quote (doc_commands --run)

MUST_QUOTE = ("README.md", "docs/recipes.md", "docs/lora.md")  # NOTE: the docs whose commands' figures are quoted


def test_each_command_names_the_output_directory_its_recipe_writes():
    for command, args in launched():
        assert command.output_dir == str(Path(args.output_dir)), str(command)


def test_every_expectation_reads_and_guards_a_documented_cpu_command():
    from support.doc_commands import expectations

    found = expectations()
    written = {c.output_dir for c in commands() if c.runs_on_a_cpu and c.output_dir}
    for e in found:
        assert e.output_dir in written, f"{e}: no documented CPU command writes {e.output_dir}"
    assert {e.doc for e in found} >= set(MUST_QUOTE)


def _planted_scratch(tmp_path: Path, nudge: dict | None = None) -> Path:
    """A scratch folder as `--run` leaves it: every documented CPU recipe command run with exit 0, and each figure
    the docs expect at the middle of its range (`nudge`: {(output_dir, metric): value} instead)."""
    from support.doc_commands import RUNS_FILE, expectations

    ran = [dict(command=str(c), output_dir=c.output_dir, rc=0, seconds=1.0) for c in commands()
           if c.runs_on_a_cpu and c.output_dir]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / RUNS_FILE).write_text(json.dumps(ran))
    summaries, tables = {}, {}
    for e in expectations():
        value = (nudge or {}).get((e.output_dir, e.metric), (e.lo + e.hi) / 2)
        if "[" in e.metric:
            name, rest = e.metric.split("[", 1)
            where, column = rest.split("]", 1)
            row = tables.setdefault((e.output_dir, name), {}).setdefault(where, dict(p.split("=", 1) for p in
                                                                                    where.split()))
            row[column.strip()] = value
            continue
        node = summaries.setdefault(e.output_dir, {})
        *parents, leaf = e.metric.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    for out, summary in summaries.items():
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        (tmp_path / out / "summary.json").write_text(json.dumps(summary))
    for (out, name), rows in tables.items():
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        columns = sorted({k for r in rows.values() for k in r})
        with open(tmp_path / out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows.values())
    return tmp_path


def test_the_check_passes_figures_in_range_and_fails_one_planted_outside(tmp_path):
    from support.doc_commands import check, expectations

    report = io.StringIO()
    assert check(_planted_scratch(tmp_path / "in"), out=report) == 0, report.getvalue()
    assert "OUT OF RANGE" not in report.getvalue()
    assert not [line for line in report.getvalue().splitlines() if line.endswith("not run")]
    assert report.getvalue().splitlines()[-1] == "0 failed, 0 expected figures of commands not run here"
    summary = next(e for e in expectations() if "[" not in e.metric)
    table = next(e for e in expectations() if "[" in e.metric)
    planted = [(e, value) for e in (summary, table) for value in (e.lo - 1e-3, e.hi + 1e-3)]
    for i, (e, value) in enumerate(planted):  # NOTE: a summary.json figure and a CSV's, each side of its range
        report = io.StringIO()
        scratch = _planted_scratch(tmp_path / f"out{i}", {(e.output_dir, e.metric): value})
        assert check(scratch, out=report) == 1, report.getvalue()
        assert "OUT OF RANGE" in report.getvalue() and f"{value:.4g}" in report.getvalue()


def test_the_check_fails_a_failed_command_and_a_missing_figure(tmp_path):
    from support.doc_commands import RUNS_FILE, check, expectations

    scratch = _planted_scratch(tmp_path)
    ran = json.loads((scratch / RUNS_FILE).read_text())
    ran[0]["rc"] = "1"
    (scratch / RUNS_FILE).write_text(json.dumps(ran))
    assert check(scratch, out=io.StringIO()) == 1
    scratch = _planted_scratch(tmp_path / "missing")
    (scratch / expectations()[0].output_dir / "summary.json").unlink()
    report = io.StringIO()
    assert check(scratch, out=report) >= 1 and "UNREADABLE" in report.getvalue()


def test_a_malformed_or_empty_expectation_is_refused_by_place(tmp_path):
    from support.doc_commands import expectations

    (tmp_path / "doc.md").write_text("text\n<!-- expect runs/x: reward_rise 0.1..0.3, greedy_after.exact 0.5 -->\n")
    with pytest.raises(ValueError, match=r"doc.md:2: cannot read the expectation 'greedy_after.exact 0.5'"):
        expectations(["doc.md"], tmp_path)
    (tmp_path / "doc.md").write_text("<!-- expect runs/x: reward_rise 0.3..0.1 -->\n")
    with pytest.raises(ValueError, match="doc.md:1: the range 0.3..0.1 of reward_rise is empty"):
        expectations(["doc.md"], tmp_path)
    (tmp_path / "doc.md").write_text("<!-- expect runs/x: sweep.csv[checkpoint=a/b n=16] pass@1 0..1 -->\n")
    (e,) = expectations(["doc.md"], tmp_path)
    assert (e.output_dir, e.metric, e.lo, e.hi) == ("runs/x", "sweep.csv[checkpoint=a/b n=16] pass@1", 0, 1)
