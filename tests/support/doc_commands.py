"""The shell commands of the README and the docs that launch a recipe or `rollout serve`, as written (issue 62), and
the figures the docs quote for them.

`tests/test_docs_commands.py` parses each through its recipe's own argument parser and checks that no two of them
write the same output directory with different runs. Run as a script, it runs the CPU ones as written (the
`.venv/bin/` of each replaced by this interpreter's), one after another in a fresh scratch folder holding links to
`recipes/` and `tests/` (a warm-start cache of its own inside it unless `--shared-warm-start-cache`), then compares
what they wrote with the docs' expectations and prints a table of command, metric, measured, range and verdict;
the exit status is non-zero if a command failed or a figure fell outside its range:

    python tests/support/doc_commands.py --list
    python tests/support/doc_commands.py --run SCRATCH [--match grpo_gsm8k_cpu] [--timeout 3600]
    python tests/support/doc_commands.py --check SCRATCH     # compare what an earlier --run left, run nothing

An expectation is an HTML comment beside the figure it guards, naming the output directory of the command that
makes it (as that command writes it) and, per metric, the range the doc states:

    <!-- expect runs/grpo: greedy_before.exact 0.25..0.35, reward_rise 0.15..0.26 -->
    <!-- expect runs/eval_sweep: sweep.csv[checkpoint=runs/grpo/final temperature=1.0 n=16] pass@1 0.38..0.50 -->

A metric is a dotted key of the run's `summary.json`, or `FILE[column=value ...] column` for the one row of a CSV
the run wrote that matches the filter (values compared as numbers when both parse as numbers).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import shutil
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
    def output_dir(self) -> str | None:
        """Where a recipe command writes: its `--output_dir`, else the recipe's default `runs/<recipe name>`."""
        if self.recipe is None:
            return None
        argv = self.recipe_argv
        given = argv[argv.index("--output_dir") + 1] if "--output_dir" in argv else f"runs/{Path(self.recipe).stem}"
        return os.path.normpath(given)

    @property
    def is_server(self) -> bool:
        return self.words[0].endswith("/rollout") and self.words[1:2] == ["serve"]

    @property
    def runs_on_a_cpu(self) -> bool:
        return not NOT_ON_A_CPU.search(self.text)

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"

    @property
    def short(self) -> str:
        """`doc:line` and the output directory (else the command's first words): a row of the check's table."""
        what = self.output_dir or " ".join([Path(self.words[0]).name, *self.words[1:3]])
        return f"{self.doc}:{self.line} {what}"


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


EXPECT = re.compile(r"<!--\s*expect\s+(\S+?):\s*(.*?)\s*-->", re.S)
RANGE = re.compile(r"(?P<metric>\S+(?:\[[^\]]*\]\s+\S+)?)\s+(?P<lo>-?[\d.e+-]+)\.\.(?P<hi>-?[\d.e+-]+)$")
RUNS_FILE = "doc_runs.json"  # in the scratch folder: each command run, its output directory and exit status


@dataclass(frozen=True)
class Expectation:
    doc: str
    line: int
    output_dir: str  # the output directory of the command whose result it guards, as that command writes it
    metric: str  # a dotted key of summary.json, or `FILE[column=value ...] column`
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.output_dir} {self.metric} {self.lo:g}..{self.hi:g}"


def expectations(docs=DOCS, root: Path = ROOT) -> list[Expectation]:
    """Every `<!-- expect OUTPUT_DIR: metric lo..hi, ... -->` of `docs`; a malformed one is a ValueError naming
    its place."""
    out = []
    for doc in docs:
        text = (root / doc).read_text()
        for m in EXPECT.finditer(text):
            line = text[:m.start()].count("\n") + 1
            for part in m.group(2).split(","):
                found = RANGE.match(" ".join(part.split()))
                if not found:
                    raise ValueError(f"{doc}:{line}: cannot read the expectation {part.strip()!r} "
                                     "(want `metric lo..hi`)")
                lo, hi = float(found["lo"]), float(found["hi"])
                if lo > hi:
                    raise ValueError(f"{doc}:{line}: the range {lo:g}..{hi:g} of {found['metric']} is empty")
                out.append(Expectation(doc, line, os.path.normpath(m.group(1)), found["metric"], lo, hi))
    return out


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def measure(output_dir: Path, metric: str) -> float:
    """The figure `metric` names in a run's `output_dir` (KeyError / FileNotFoundError naming what is missing)."""
    if "[" in metric:
        name, rest = metric.split("[", 1)
        where, column = rest.split("]", 1)
        wanted = dict(pair.split("=", 1) for pair in where.split())
        with open(output_dir / name) as f:
            rows = [r for r in csv.DictReader(f) if all(_number(r.get(k)) == _number(v) for k, v in wanted.items())]
        if len(rows) != 1:
            raise KeyError(f"{len(rows)} rows of {name} match {where!r} (want one)")
        return float(rows[0][column.strip()])
    value = json.loads((output_dir / "summary.json").read_text())
    for key in metric.split("."):
        value = value[key]
    return float(value)


def check(scratch: Path, docs=DOCS, root: Path = ROOT, out=sys.stdout) -> int:
    """Compare what the commands run in `scratch` wrote (`RUNS_FILE`) with the docs' expectations; prints a table
    and returns how many commands failed plus how many figures fell outside their ranges or could not be read.
    An expectation of a command not run there is listed as such and is no failure."""
    ran = json.loads((scratch / RUNS_FILE).read_text()) if (scratch / RUNS_FILE).exists() else []
    status = {r["output_dir"]: r for r in ran if r["output_dir"]}
    rows, bad = [], sum(r["rc"] != 0 for r in ran)
    for r in ran:
        rows.append((r.get("where", r["command"]), "exit status", str(r["rc"]), "0", "ok" if r["rc"] == 0 else "FAIL"))
    for e in expectations(docs, root):
        where = f"{e.doc}:{e.line} {e.output_dir}"
        if e.output_dir not in status:
            rows.append((where, e.metric, "-", f"{e.lo:g}..{e.hi:g}", "not run"))
            continue
        try:
            value = measure(scratch / e.output_dir, e.metric)
            verdict = "ok" if e.lo <= value <= e.hi else "OUT OF RANGE"
            shown = f"{value:.4g}"
        except (OSError, KeyError, ValueError) as err:
            verdict, shown = "UNREADABLE", f"{type(err).__name__}: {err}"
        bad += verdict != "ok"
        rows.append((where, e.metric, shown, f"{e.lo:g}..{e.hi:g}", verdict))
    widths = [min(90, max(len(r[i]) for r in rows)) if rows else 0 for i in range(5)]
    for r in [("command / doc", "metric", "measured", "range", "verdict"), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)
    print(f"{bad} failed, {sum(r[-1] == 'not run' for r in rows)} expected figures of commands not run here", file=out)
    return bad


def run(scratch: Path, match: str | None, timeout: float, shared_cache: bool = False) -> int:
    """Run the CPU commands (those matching `match`) as written in `scratch`, recording each in `RUNS_FILE`;
    returns how many failed. A command whose output directory an earlier one wrote (the same run, written two ways)
    finds it moved aside to `DIR.before-LINE` first, so no command writes over another's output."""
    scratch.mkdir(parents=True, exist_ok=True)
    for name in ("recipes", "tests"):
        if not (scratch / name).exists():
            (scratch / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if not shared_cache:  # NOTE: as on a fresh machine: the warm start is built, once, by the first recipe
        env["ROLLOUT_WARM_START_CACHE"] = str(scratch / "warm_start_cache")
    ran = json.loads((scratch / RUNS_FILE).read_text()) if (scratch / RUNS_FILE).exists() else []
    failed, seen = 0, set()
    for command in commands():
        if not command.runs_on_a_cpu or command.text in seen or (match and match not in command.text):
            continue
        seen.add(command.text)
        if command.is_server:
            print(f"[not run] a server (tests/serve/ start and query one)  {command}")
            continue
        if command.output_dir and (scratch / command.output_dir).exists():
            shutil.move(scratch / command.output_dir, scratch / f"{command.output_dir}.before-{command.line}")
        text = command.text.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
        start, load = time.perf_counter(), os.getloadavg()[0]
        try:
            done = subprocess.run(text, shell=True, cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            # NOTE: a run's summary lines are on stdout (its progress bars on stderr); a failure's cause on stderr
            rc, tail = done.returncode, (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()[-4:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", []
        seconds = time.perf_counter() - start
        failed += rc != 0
        print(f"[{'ok' if rc == 0 else 'FAILED ' + str(rc)}] {seconds:.0f} s (load {load:.1f} -> "
              f"{os.getloadavg()[0]:.1f})  {command}", flush=True)
        for line in tail:
            print("    " + line[-300:], flush=True)
        ran.append(dict(command=str(command), where=command.short, output_dir=command.output_dir,
                        rc=rc if rc == 0 else str(rc),
                        seconds=round(seconds, 1)))
        (scratch / RUNS_FILE).write_text(json.dumps(ran, indent=1))
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="print every command and whether it runs on a CPU")
    p.add_argument("--run", type=Path, default=None, help="run the CPU commands in this scratch folder, then check")
    p.add_argument("--check", type=Path, default=None, help="check what an earlier --run left in this folder")
    p.add_argument("--match", default=None, help="only the commands containing this text")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one command may take")
    p.add_argument("--shared-warm-start-cache", action="store_true",
                   help="use the machine's warm-start cache instead of one of the scratch folder's own")
    args = p.parse_args(argv)
    if args.run is not None:
        run(args.run, args.match, args.timeout, args.shared_warm_start_cache)
        return 1 if check(args.run) else 0
    if args.check is not None:
        return 1 if check(args.check) else 0
    for command in commands():
        print(f"{'cpu' if command.runs_on_a_cpu else 'gpu/cluster'}  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
