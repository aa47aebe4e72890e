"""The shell commands of the README and the docs that launch a recipe or `rollout serve`, as written (issue 62).

`tests/test_docs_commands.py` parses each through its recipe's own argument parser and checks that no two of them
write the same output directory with different runs. Run as a script, it runs the CPU ones as written (the
`.venv/bin/` of each replaced by this interpreter's), one after another in a scratch folder holding links to
`recipes/` and `tests/`, and reports each one's exit status, wall time and closing lines:

    python tests/support/doc_commands.py --list
    python tests/support/doc_commands.py --run SCRATCH [--match grpo_gsm8k_cpu] [--timeout 3600]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/recipes.md", "docs/lora.md", "docs/fleets.md", "docs/launching.md",
        "docs/async-and-fleets.md")
# NOTE: what a CPU box can run as written (no GPU config, no hub model or dataset, no placeholder to fill in)
NOT_ON_A_CPU = re.compile(r"1gpu\.yaml|multi_gpu\.yaml|fsdp\.yaml(?<!2cpu_fsdp\.yaml)|Qwen/|openai/|HEAD_IP|"
                          r"LEARNER0_IP|BASE_DIR|data/train|data/test|ray start")


@dataclass
class DocCommand:
    doc: str
    line: int
    text: str  # the command as written, continuation lines joined, the trailing comment dropped

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def recipe(self) -> str | None:
        """`recipes/NAME.py` when the command launches a recipe."""
        return next((w for w in self.words if re.fullmatch(r"recipes/\w+\.py", w)), None)

    @property
    def recipe_argv(self) -> list[str]:
        words = self.words
        return words[words.index(self.recipe) + 1:]

    @property
    def runs_on_a_cpu(self) -> bool:
        return not NOT_ON_A_CPU.search(self.text)

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _strip_comment(line: str) -> str:
    """A bash line without its trailing `# comment` (a `#` outside quotes that starts a word)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(docs=DOCS, root: Path = ROOT) -> list[DocCommand]:
    """Every `.venv/bin/...` command of `docs`: the lines of ```bash blocks (continuations joined) and inline
    code spans that start with `.venv/bin/`."""
    out = []
    for doc in docs:
        lines = (root / doc).read_text().splitlines()
        in_bash, pending, start, outside = False, "", 0, []
        for number, line in enumerate(lines, start=1):
            outside.append("" if in_bash or line.startswith("```") else line)
            if line.startswith("```"):
                in_bash = line.strip() == "```bash" if not in_bash else False
                continue
            if in_bash:
                code = _strip_comment(line)
                if not pending:
                    start = number
                if code.endswith("\\"):
                    pending += code[:-1].strip() + " "
                    continue
                text = (pending + code.strip()).strip()
                pending = ""
                if text.startswith(".venv/bin/"):
                    out.append(DocCommand(doc, start, text))
        prose = "\n".join(outside)  # NOTE: an inline span may wrap onto the next line
        for m in re.finditer(r"`(\.venv/bin/[^`]+)`", prose):
            out.append(DocCommand(doc, prose[:m.start()].count("\n") + 1, " ".join(m.group(1).split())))
    return sorted(out, key=lambda c: (DOCS.index(c.doc) if c.doc in DOCS else len(DOCS), c.line))


def run(scratch: Path, match: str | None, timeout: float) -> int:
    """Run the CPU commands (those matching `match`) as written in `scratch`; returns how many failed."""
    scratch.mkdir(parents=True, exist_ok=True)
    for name in ("recipes", "tests"):
        if not (scratch / name).exists():
            (scratch / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    failed, seen = 0, set()
    for command in commands():
        if not command.runs_on_a_cpu or command.text in seen or (match and match not in command.text):
            continue
        seen.add(command.text)
        text = command.text.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
        start = time.perf_counter()
        try:
            done = subprocess.run(text, shell=True, cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            # NOTE: a run's summary lines are on stdout (its progress bars on stderr); a failure's cause on stderr
            rc, tail = done.returncode, (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()[-4:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", []
        failed += rc != 0
        print(f"[{'ok' if rc == 0 else 'FAILED ' + str(rc)}] {time.perf_counter() - start:.0f} s  {command}")
        for line in tail:
            print("    " + line[-300:])
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="print every command and whether it runs on a CPU")
    p.add_argument("--run", type=Path, default=None, help="run the CPU commands in this scratch folder")
    p.add_argument("--match", default=None, help="only the commands containing this text")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one command may take")
    args = p.parse_args(argv)
    if args.run is not None:
        return 1 if run(args.run, args.match, args.timeout) else 0
    for command in commands():
        print(f"{'cpu' if command.runs_on_a_cpu else 'gpu/cluster'}  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
