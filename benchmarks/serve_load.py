"""Load on `rollout serve` from a tool nobody here wrote: guidellm (issue 45). Starts the server on a tiny
model, runs `guidellm run` for each (request format, profile), parses guidellm's JSON report, checks that no
request errored and that every KV page is free afterwards (`/metrics`), and prints one table.

    python benchmarks/serve_load.py --guidellm /work/venv-clients/bin/guidellm
    python benchmarks/serve_load.py --venv /work/venv-clients --runs chat:concurrent:2,4 --neighbour 1 \
        --threads 1 --omp-wait-policy PASSIVE        # latency at low concurrency beside a busy neighbour

guidellm (0.8) lives in a venv of its own (`pip install guidellm==0.8.1`; it pins its own torch): the
project's venv is untouched. The model is `tests/support/serving.save_tiny` (a 2-layer Qwen3-architecture
model, character tokenizer with a chat template that renders string content) unless `--model DIR`;
guidellm's synthetic prompts are built with that tokenizer. Runs are `FORMAT:PROFILE[:ARG]`, FORMAT `chat`
(`/v1/chat/completions`, messages with content parts as guidellm sends them) or `text` (`/v1/completions`),
PROFILE `synchronous`, `concurrent:S1,S2,...` (streams) or `sweep:N` (guidellm's sweep: synchronous,
throughput, then N-2 constant rates in between). Every benchmark stops at `--max-requests` or
`--max-seconds`, whichever first. Streams are SSE with `continuous_usage_stats` (guidellm's default).
`--neighbour K` runs K busy-loop processes beside the server for the whole run (a CPU-bound neighbour; each
stops itself after an hour if this script dies). Exit status 1 when any request errored or a page is held.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

FORMATS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
KEY = "load-key"
BURN = "import time\nend = time.monotonic() + 3600\nwhile time.monotonic() < end:\n    pass\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", default=None, help="the guidellm executable (default: --venv's, then PATH)")
    p.add_argument("--venv", default=None, help="a venv with guidellm installed (its bin/guidellm)")
    p.add_argument("--model", default=None, help="a save_pretrained directory (default: the tiny test model)")
    p.add_argument("--runs", nargs="+", default=["chat:synchronous", "chat:concurrent:4,16", "text:synchronous",
                                                  "text:concurrent:4,16"])
    p.add_argument("--max-requests", type=int, default=100, help="per benchmark")
    p.add_argument("--max-seconds", type=float, default=30.0, help="per benchmark")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the server's OMP_NUM_THREADS")
    p.add_argument("--omp-wait-policy", default=None, help="the server's OMP_WAIT_POLICY (default: unset)")
    p.add_argument("--neighbour", type=int, default=0, help="busy-loop processes beside the server")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="extra `rollout serve` flags (last on the line)")
    p.add_argument("--out-dir", default=None, help="keep guidellm's JSON reports and a summary.json here")
    return p.parse_args(argv)


def find_guidellm(args) -> str:
    for candidate in (args.guidellm, args.venv and str(Path(args.venv) / "bin" / "guidellm"), shutil.which("guidellm")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("guidellm not found: pass --guidellm PATH or --venv DIR (pip install guidellm==0.8.1 there)")


def parse_run(run: str) -> tuple[str, dict]:
    """`chat:concurrent:2,4` -> ("chat", {"kind": "concurrent", "streams": [2, 4]})."""
    fmt, kind, *rest = run.split(":") + [""]
    if fmt not in FORMATS or kind not in ("synchronous", "concurrent", "sweep"):
        raise SystemExit(f"bad run {run!r}: FORMAT:PROFILE[:ARG] with FORMAT in {sorted(FORMATS)} and PROFILE "
                         "synchronous, concurrent:S1,S2 or sweep:N")
    if kind == "concurrent":
        return fmt, {"kind": kind, "streams": [int(s) for s in (rest[0] or "4").split(",")]}
    if kind == "sweep":
        return fmt, {"kind": kind, "sweep_size": int(rest[0] or 4)}
    return fmt, {"kind": kind}


def scenario(url: str, model_dir: str, fmt: str, profile: dict, args, report: Path) -> dict:
    """A guidellm scenario file (its `spec` is the `guidellm run` options)."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": "tiny", "request_format": FORMATS[fmt],
                    "api_key": KEY},
        "profile": profile,
        "tokenizer": {"kind": "huggingface_auto", "model": model_dir},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                  "output_tokens": args.output_tokens}],
        "constraints": [{"kind": "max_requests", "count": args.max_requests},
                        {"kind": "max_duration", "seconds": args.max_seconds}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}


def stat(metrics: dict, name: str, key: str, scale: float = 1.0) -> float | None:
    dist = metrics.get(name, {}).get("successful") or {}
    value = dist.get(key) if key in ("mean", "median") else (dist.get("percentiles") or {}).get(key)
    return None if value is None else value * scale


def summarize(report: dict) -> list[dict]:
    """One row per benchmark of a guidellm JSON report."""
    rows = []
    for b in report["benchmarks"]:
        m, strategy = b["metrics"], b["config"]["strategy"]
        totals = m["request_totals"]
        name = strategy["type_"]
        if strategy.get("streams"):
            name += f" {strategy['streams']}"
        elif strategy.get("rate"):
            name += f" {strategy['rate']:.1f}/s"
        out_tokens = (m["output_token_count"].get("successful") or {}).get("total_sum") or 0
        rows.append({
            "profile": name, "ok": totals["successful"], "errored": totals["errored"],
            "incomplete": totals["incomplete"], "seconds": b["duration"],
            "req_s": totals["successful"] / b["duration"] if b["duration"] else 0.0,
            "out_tok_s": out_tokens / b["duration"] if b["duration"] else 0.0,
            "ttft_p50_ms": stat(m, "time_to_first_token_ms", "median"),
            "ttft_p95_ms": stat(m, "time_to_first_token_ms", "p95"),
            "itl_p50_ms": stat(m, "inter_token_latency_ms", "median"),
            "itl_p95_ms": stat(m, "inter_token_latency_ms", "p95"),
            "tpot_p95_ms": stat(m, "time_per_output_token_ms", "p95"),
            "latency_p50_s": stat(m, "request_latency", "median"),
            "latency_p95_s": stat(m, "request_latency", "p95"),
        })
    return rows


def pages(url: str) -> tuple[float, float]:
    """(free_blocks, num_blocks) from the server's /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    values = {k: float(v) for k, v in re.findall(r"^rollout_(free_blocks|num_blocks) (\S+)$", text, re.M)}
    return values["free_blocks"], values["num_blocks"]


def pages_free(url: str, timeout_s: float = 20.0) -> tuple[bool, float, float]:
    """Wait (bounded) for every page to be free: requests cancelled by guidellm's stop finish their step."""
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = pages(url)
        if free == total or time.monotonic() > deadline:
            return free == total, free, total
        time.sleep(0.2)


def fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table(rows: list[dict]) -> str:
    head = ("| format | profile | ok | errored | incomplete | req/s | out tok/s | TTFT p50 / p95 ms | ITL p50 / p95 ms "
            "| TPOT p95 ms | latency p50 / p95 s | pages free after |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['format']} | {r['profile']} | {r['ok']} | {r['errored']} | {r['incomplete']} | "
                     f"{fmt(r['req_s'])} | {fmt(r['out_tok_s'], 0)} | {fmt(r['ttft_p50_ms'])} / "
                     f"{fmt(r['ttft_p95_ms'])} | {fmt(r['itl_p50_ms'], 2)} / {fmt(r['itl_p95_ms'], 2)} | "
                     f"{fmt(r['tpot_p95_ms'], 2)} | {fmt(r['latency_p50_s'], 3)} / {fmt(r['latency_p95_s'], 3)} | "
                     f"{r['pages']} |")
    return "\n".join(lines)


def start_neighbours(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BURN], start_new_session=True) for _ in range(n)]


def stop_neighbours(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait(10)


def run_guidellm(exe: str, spec: dict, workdir: Path, timeout_s: float) -> tuple[dict | None, str]:
    path = workdir / "scenario.json"
    path.write_text(json.dumps(spec))
    report = Path(spec["spec"]["outputs"][0]["path"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # NOTE: guidellm's venv, not ours
    proc = subprocess.run([exe, "run", "--scenario", str(path), "--disable-console-interactive"], cwd=workdir,
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not report.is_file():
        return None, log
    return json.loads(report.read_text()), log


def main(argv=None) -> int:
    args = parse_args(argv)
    exe = find_guidellm(args)
    from rollout.fleet.server_procs import ServerProcesses, install_signal_handlers

    install_signal_handlers()
    work = Path(args.out_dir or tempfile.mkdtemp(prefix="serve-load-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = args.model
    if model_dir is None:
        from support.serving import save_tiny

        model_dir = str(save_tiny(work / "model"))
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    load = os.getloadavg()
    print(f"guidellm: {exe}; model: {model_dir}; server OMP_NUM_THREADS={args.threads} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; neighbours: {args.neighbour}; "
          f"load before: {load[0]:.2f}", flush=True)
    serve_args = ["--served-model-name", "tiny", "--api-key", KEY, "--page-size", "16", "--num-blocks", "1024",
                  "--log-level", "warning", *args.serve_args]
    rows, failed = [], False
    with ServerProcesses(model_dir, threads=args.threads, serve_args=serve_args, log_dir=str(work / "server"),
                         start_timeout_s=300) as servers:
        url = servers.urls[0]
        neighbours = start_neighbours(args.neighbour)
        try:
            for i, run in enumerate(args.runs):
                fmt_name, profile = parse_run(run)
                n_bench = len(profile.get("streams", [1])) if profile["kind"] != "sweep" else profile["sweep_size"]
                spec = scenario(url, model_dir, fmt_name, profile, args, work / f"guidellm_{i}_{fmt_name}.json")
                report, log = run_guidellm(exe, spec, work, timeout_s=120 + 2 * n_bench * args.max_seconds)
                (work / f"guidellm_{i}_{fmt_name}.log").write_text(log)
                ok, free, total = pages_free(url)
                if report is None:
                    print(f"{run}: guidellm failed\n{log[-3000:]}", flush=True)
                    failed = True
                    continue
                for row in summarize(report):
                    row.update(format=fmt_name, run=run, pages=f"{free:.0f}/{total:.0f}")
                    failed |= row["errored"] > 0 or not ok
                    rows.append(row)
                print(f"{run}: {sum(r['ok'] for r in rows if r['run'] == run)} ok, "
                      f"{sum(r['errored'] for r in rows if r['run'] == run)} errored, pages {free:.0f}/{total:.0f} "
                      "free", flush=True)
        finally:
            stop_neighbours(neighbours)
        server_log = servers.tail(0, 20000)
    if "Traceback" in server_log:
        print("the server logged a traceback:\n" + server_log[-3000:])
        failed = True
    load = os.getloadavg()
    print(f"\nload after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print(table(rows))
    (work / "summary.json").write_text(json.dumps({"rows": rows, "args": vars(args), "failed": failed}, indent=1))
    print(f"\nreports in {work}; {'FAILED' if failed else 'all requests ok, every page free'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
