"""vLLM's CPU build on one workload, run in its own venv (see benchmarks/common.py `run_vllm`).

    /work/vllm-venv/bin/python benchmarks/vllm_cpu.py IN.json OUT.json

IN.json: {"model": save_pretrained dir, "dtype": "float32" | "bfloat16", "threads": int,
"prompts": [[ids]], "max_new": [int], "warmup": [[ids]]}. OUT.json: {"seconds": wall time of the
timed `generate`, "outputs": [[generated ids]], "init_seconds": engine start-up, "cpu_seconds": CPU time of this
process and all its children (vLLM's engine-core and worker processes) during the timed `generate`, when psutil is
importable}. Greedy, EOS ignored,
no tokenizer, each request with its own max_tokens; the engine and its compile warm-up are built
before the clock starts, and one small warm-up batch runs first.

The thread binding is set from "threads" (`VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`) unless the
caller's environment sets it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def start_llm(doc: str):
    """The runner's common start (this script's and `vllm_scoring.py`'s): `argv` is `IN.json OUT.json` (else
    print `doc` and exit), vLLM pinned to the job's threads; returns (job, LLM, start-up seconds, OUT path)."""
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(doc)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    with open(sys.argv[1]) as f:
        job = json.load(f)
    threads = int(job["threads"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM  # noqa: PLC0415

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype=job["dtype"], seed=0)
    return job, llm, time.perf_counter() - t0, sys.argv[2]


def main() -> None:
    job, llm, init, dst = start_llm(__doc__)
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    def run(prompts, max_new):
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in max_new]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    run(job["warmup"], [8] * len(job["warmup"]))
    c0 = tree_cpu_seconds()
    t0 = time.perf_counter()
    outputs = run(job["prompts"], job["max_new"])
    seconds = time.perf_counter() - t0
    cpu = None if c0 is None else tree_cpu_seconds() - c0
    with open(dst, "w") as f:
        json.dump({"seconds": seconds, "outputs": outputs, "init_seconds": init, "cpu_seconds": cpu}, f)


def tree_cpu_seconds() -> float | None:
    """User + system CPU seconds of this process and its live descendants (vLLM runs its engine core and its
    worker in processes of their own, so "threads" bounds the worker's OpenMP threads, not the cores used)."""
    try:
        import psutil  # noqa: PLC0415
    except ImportError:
        return None
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


if __name__ == "__main__":
    main()
