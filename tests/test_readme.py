"""The README is a front door that works: its quick-start Python example runs (on a tiny local model),
its test command is the one CI runs, its commands use the quick start's `.venv`, and its links and the
manual's (`docs/`) point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from support.markdown import FENCE

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = "<!-- quickstart -->"
MODEL_LINE = re.compile(r'^model_id = "([^"]+)"$', re.M)


def marked_blocks(text: str, lang: str) -> list[str]:
    """The fenced `lang` blocks that directly follow a `<!-- quickstart -->` line."""
    blocks = []
    for part in text.split(MARKER)[1:]:
        match = FENCE.match(part.lstrip("\n"))
        assert match is not None, f"{MARKER} must be followed by a fenced block"
        if match.group(1) == lang:
            blocks.append(match.group(2))
    return blocks


def quickstart_example(text: str, model_path: str) -> str:
    """The README's quick-start Python code with its `model_id = "..."` line pointed at `model_path`."""
    blocks = marked_blocks(text, "python")
    assert len(blocks) == 1, f"expected one python block after {MARKER}, found {len(blocks)}"
    code = blocks[0]
    assert len(MODEL_LINE.findall(code)) == 1, 'the example must load its model from one `model_id = "..."` line'
    return MODEL_LINE.sub(f"model_id = {model_path!r}", code)


def run_quickstart(text: str, model_path: str) -> dict:
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(quickstart_example(text, model_path), "README.md:quickstart", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 and a character-level tokenizer, saved like a hub checkpoint (no download)."""
    from support.chat_model import save_tiny_chat_model

    return save_tiny_chat_model(str(tmp_path_factory.mktemp("readme_model")))


@pytest.mark.timeout(120)
def test_quickstart_example_runs_and_returns_grouped_rollouts(tiny_model_dir):
    ns = run_quickstart(README.read_text(), tiny_model_dir)
    batch, prompts, tokenizer = ns["batch"], ns["prompts"], ns["tokenizer"]
    n = batch.completion_ids.shape[0]
    assert n % len(prompts) == 0 and n > len(prompts), "several samples per prompt"
    group = n // len(prompts)
    # groups adjacent, each row after its own prompt (left-padded)
    assert batch.group_ids.tolist() == [i for i in range(len(prompts)) for _ in range(group)]
    for row in range(n):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        assert prompt == tokenizer(prompts[row // group]).input_ids
    # tokens came back, with a logprob for each and nothing where masked
    mask = batch.completion_mask.bool()
    assert batch.logprobs.shape == batch.completion_ids.shape and batch.logprobs.dtype == torch.float32
    assert mask.sum(dim=1).min() >= 1
    assert torch.isfinite(batch.logprobs).all() and (batch.logprobs[mask] <= 0).all()
    assert (batch.logprobs[mask] < 0).any(), "sampled tokens carry real logprobs"
    assert (batch.logprobs[~mask] == 0).all() and (batch.completion_ids[~mask] == tokenizer.pad_token_id).all()
    assert batch.input_ids.shape == (n, batch.prompt_ids.shape[1] + batch.completion_ids.shape[1])
    assert len(batch.finish_reasons) == n and set(batch.finish_reasons) <= {"stop", "length"}
    assert len(batch.completions_text) == n
    # the weight update after the optimizer step bumped the policy version
    assert ns["version"] == batch.policy_version + 1


def test_quickstart_example_break_is_caught(tiny_model_dir):
    """The example runs as written: a README whose example calls a missing method fails here."""
    broken = README.read_text().replace("engine.generate(", "engine.generate_rollouts(", 1)
    with pytest.raises(AttributeError):
        run_quickstart(broken, tiny_model_dir)


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = [line for line in ci if line.startswith("python3 -m venv")]
    assert len(command) == 1, ".ci/run runs one install-and-test command"
    lines = README.read_text().splitlines()
    assert command[0] in lines[:60], "the README's quick start (first 60 lines) shows CI's test command verbatim"
    assert "pytest" in command[0]


def test_readme_fits_on_a_front_door():
    assert len(README.read_text().splitlines()) <= 250


BARE = re.compile(r"^(accelerate|rollout|python|pytest|torchrun|lint-imports|ruff|pip)\s")


def command_lines(text: str):
    for lang, body in FENCE.findall(text):
        if lang in ("bash", "sh", "shell"):
            for line in body.splitlines():
                yield line.strip()


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_commands_use_the_quick_start_venv(page):
    """The quick start installs into `.venv`: a command shown as bare `accelerate` / `rollout` / `python`
    would run whatever is on PATH instead."""
    bare = [line for line in command_lines(page.read_text()) if BARE.match(line)]
    assert not bare, f"{page.name}: use .venv/bin/...: {bare}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
