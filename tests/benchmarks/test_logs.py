"""benchmarks/logs/ is one folder per benchmark, indexed, and every log a page names exists.

- every file under `benchmarks/logs/` sits in a benchmark's folder (`logs/<benchmark>/`, superseded runs in
  `logs/<benchmark>/archive/`), and every folder is a row of benchmarks/README.md's `## logs/` table, whose
  rows name only folders that exist;
- every path to a log that a markdown page of the repository names (`benchmarks/logs/...`, or `logs/...`
  inside benchmarks/, `../benchmarks/logs/...` from docs/) exists: a glob (`*`, `{a,b}`, `<run>`) matches
  something, and a path a shown command writes (`--out PATH`, `--json PATH`, `> PATH`) has its folder.
  A log deleted from the tree is named as `git show COMMIT:benchmarks/logs/...`, which is not checked.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "benchmarks" / "logs"
INDEX = ROOT / "benchmarks" / "README.md"
# NOTE: not after a word, `:` (git show REV:path), `/` or `.` (a longer path or a URL)
LOG_PATH = re.compile(r"(?<![\w:/.-])((?:\.\./)*(?:benchmarks/)?logs/[\w*{},<>./-]*)")
WRITES = re.compile(r"(?:--[\w-]+[ =]|> ?)$")  # the path is a shown command's output


def markdown_pages(root: Path) -> list[Path]:
    skip = {".git", ".venv", "node_modules"}
    logs = root / "benchmarks" / "logs"
    return sorted(p for p in root.rglob("*.md")
                  if not skip & set(p.relative_to(root).parts) and not p.is_relative_to(logs))


def expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [q for alt in match.group(1).split(",")
            for q in expand_braces(path[: match.start()] + alt + path[match.end():])]


def missing_log_paths(root: Path) -> list[str]:
    problems = []
    for page in markdown_pages(root):
        in_benchmarks = page.parent == root / "benchmarks"
        for i, line in enumerate(page.read_text().splitlines(), 1):
            for m in LOG_PATH.finditer(line):
                path = m.group(1).rstrip(".,;:")
                if path.startswith("logs/") and not in_benchmarks:
                    continue  # prose or link text ("[logs/gpu](...)"); the link's target is checked
                base = root if path.startswith("benchmarks/") else page.parent
                writes = bool(WRITES.search(line[: m.start()]))
                for variant in expand_braces(path):
                    target = str(base / variant)
                    if writes:
                        target = str(Path(target).parent)
                    pattern = re.sub(r"<[^>]*>", "*", target)
                    problem = (f"{page.relative_to(root)}:{i} names {path}, but "
                               f"{Path(pattern).relative_to(root)} does not exist")
                    if not glob.glob(pattern) and problem not in problems:  # link text and target: once
                        problems.append(problem)
    return problems


def index_folders(index: Path) -> dict[str, int]:
    """The folders of the README's `## logs/` table, with their lines."""
    text = index.read_text()
    start = text.index("\n## logs/")
    end = text.find("\n## ", start + 1)
    first = text[:start].count("\n") + 2
    rows = {}
    for i, line in enumerate(text[start:end if end != -1 else None].splitlines(), first - 1):
        m = re.match(r"\| `([\w-]+)/` \|", line)
        if m:
            rows[m.group(1)] = i
    return rows


def layout_problems(root: Path) -> list[str]:
    logs, index = root / "benchmarks" / "logs", root / "benchmarks" / "README.md"
    problems = [f"benchmarks/logs/{p.name} is a loose file: move it into its benchmark's folder"
                for p in sorted(logs.iterdir()) if p.is_file()]
    rows = index_folders(index)
    for folder in sorted(p.name for p in logs.iterdir() if p.is_dir()):
        if folder == "archive":
            problems.append("benchmarks/logs/archive/: superseded runs go in logs/<benchmark>/archive/")
        elif folder not in rows:
            problems.append(f"benchmarks/logs/{folder}/ has no row in benchmarks/README.md's `## logs/` "
                            f"table: add `| `{folder}/` | its script | what | rollout at |`")
    for folder, line in rows.items():
        if not (logs / folder).is_dir():
            problems.append(f"benchmarks/README.md:{line} indexes logs/{folder}/, which does not exist")
    return problems


def test_logs_are_one_indexed_folder_per_benchmark():
    problems = layout_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_every_log_a_page_names_exists():
    problems = missing_log_paths(ROOT)
    assert not problems, "\n".join(problems)


def test_the_checks_fail_on_a_broken_scratch_copy(tmp_path):
    """The two checks on a scratch tree: a loose log, an unindexed folder, a stale path, a missing glob."""
    (tmp_path / "benchmarks/logs/throughput").mkdir(parents=True)
    (tmp_path / "benchmarks/logs/throughput/5m.txt").write_text("x")
    (tmp_path / "benchmarks/logs/moe").mkdir()
    (tmp_path / "benchmarks/logs/loose.txt").write_text("x")
    (tmp_path / "benchmarks/README.md").write_text(
        "run `python t.py --out benchmarks/logs/throughput/new_run.json`, see [a](logs/throughput/5m.txt)\n\n"
        "## logs/\n\n| folder | script |\n|---|---|\n| `throughput/` | `t.py` |\n| `gone/` | `g.py` |\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/page.md").write_text(
        "see [x](../benchmarks/logs/throughput/5m.txt), `benchmarks/logs/throughput/{5m,6m}.txt`, "
        "`benchmarks/logs/moe/*.txt`, `git show abc:benchmarks/logs/old.txt`, [logs/throughput](x)\n")
    layout = layout_problems(tmp_path)
    assert layout == [
        "benchmarks/logs/loose.txt is a loose file: move it into its benchmark's folder",
        "benchmarks/logs/moe/ has no row in benchmarks/README.md's `## logs/` table: "
        "add `| `moe/` | its script | what | rollout at |`",
        "benchmarks/README.md:8 indexes logs/gone/, which does not exist",
    ]
    assert missing_log_paths(tmp_path) == [
        "docs/page.md:1 names benchmarks/logs/throughput/{5m,6m}.txt, but "
        "benchmarks/logs/throughput/6m.txt does not exist",
        "docs/page.md:1 names benchmarks/logs/moe/*.txt, but benchmarks/logs/moe/*.txt does not exist",
    ]
