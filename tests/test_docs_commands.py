"""The README's and the docs' recipe commands parse as written and never write the same output directory with
different runs (issue 62: the fleet and async commands of the docs overwrote the demo's `runs/grpo`); every
`rollout serve DIR/final` they show serves what one of them writes. Running them: `tests/support/doc_commands.py`."""

from __future__ import annotations

import importlib.util
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
