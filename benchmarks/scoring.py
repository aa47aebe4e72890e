"""Teacher-forced scoring throughput: `RolloutEngine.score` vs a padded HF forward vs vLLM-CPU's
`prompt_logprobs`, on the RL workload (groups of G completions sharing a prompt).

    PYTHONPATH=. python benchmarks/scoring.py --threads 2 --json benchmarks/logs/scoring/5m_fp32_g8.json

The question a trainer asks: given N (prompt, completion) rows, how fast do we get each completion token's
logprob (a reference model's for the KL term, a teacher's for distillation, PPO's old logprobs)?
- `score`: `RolloutEngine.score(prompts, completions)` (default config): chunked, a group's prompt computed
  once (forked), only the completion positions' logits kept.
- `padded`: what the trainers did: rows padded to [N, P + T] (prompts left, completions right), one forward
  per micro-batch of `--micro-batch` rows, `log_softmax` then gather on the completion positions.
- `vllm`: vLLM-CPU 0.32 in its own venv and process (benchmarks/vllm_scoring.py): each row prompt +
  completion as one request with `prompt_logprobs=0`, `max_tokens=1` (only the completion's part counts).
Throughput counts completion tokens scored per second (the useful tokens); each system's logprobs are
checked against `score`'s before its time is printed. One run each (after a warm-up), `uptime` before and
after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    VLLM_PYTHON,
    machine_info,
    make_model,
    rl_workload,
    rollout_version,
    vllm_available,
)
from rollout import ContinuousBatchingConfig, RolloutEngine  # noqa: E402


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def rows(args):
    vocab = make_model(args.model).config.vocab_size
    wl = rl_workload(args.prompts, args.group, vocab, tuple(args.prompt_len), tuple(args.completion_len), seed=0)
    g = torch.Generator().manual_seed(1)
    completions = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in wl.max_new]
    return wl.prompts, completions


def run_score(model, prompts, completions):
    engine = RolloutEngine(model, config=ContinuousBatchingConfig(logprobs_mode="raw"))
    engine.score(prompts[:4], [c[:8] for c in completions[:4]])  # warm-up (kernel build, first step)
    engine.manager.core.reset_prefix_cache()
    before = engine.cache_stats()
    t0 = time.perf_counter()
    out = engine.score(prompts, completions)
    seconds = time.perf_counter() - t0
    stats = {k: v - before[k] for k, v in engine.cache_stats().items() if isinstance(v, int)}
    engine.close()
    lps = [out.logprobs[i, : len(c)] for i, c in enumerate(completions)]
    return seconds, lps, {k: stats[k] for k in ("computed_prompt_tokens", "cached_prompt_tokens")}


@torch.inference_mode()
def run_padded(model, prompts, completions, micro_batch: int):
    def once(ps, cs):
        out = []
        for s in range(0, len(ps), micro_batch):
            bp, bc = ps[s : s + micro_batch], cs[s : s + micro_batch]
            p_len, t_len = max(map(len, bp)), max(map(len, bc))
            ids = torch.zeros((len(bp), p_len + t_len), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, c) in enumerate(zip(bp, bc, strict=True)):
                ids[i, p_len - len(p) : p_len + len(c)] = torch.tensor(p + c)
                mask[i, p_len - len(p) : p_len + len(c)] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, p_len - 1 : -1].float()
            lp = logits.log_softmax(-1).gather(2, ids[:, p_len:, None])[..., 0]
            out += [lp[i, : len(c)] for i, c in enumerate(bc)]
        return out

    once(prompts[:4], [c[:8] for c in completions[:4]])
    t0 = time.perf_counter()
    lps = once(prompts, completions)
    return time.perf_counter() - t0, lps, {}


def run_vllm(model, prompts, completions, threads: int):
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(os.path.join(d, "model"))
        job, res = os.path.join(d, "in.json"), os.path.join(d, "out.json")
        seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
        with open(job, "w") as f:
            json.dump(dict(model=os.path.join(d, "model"), dtype="float32", threads=threads, sequences=seqs,
                           warmup=[s[:32] for s in seqs[:4]]), f)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_scoring.py")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([VLLM_PYTHON, script, job, res], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM-CPU failed ({proc.returncode}): {proc.stderr[-3000:]}")
        with open(res) as f:
            out = json.load(f)
    lps = [torch.tensor(lp[len(p) - 1 :]) for lp, p in zip(out["logprobs"], prompts, strict=True)]
    return out["seconds"], lps, {"init_seconds": out["init_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="5m", choices=["5m", "100m"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512])
    ap.add_argument("--completion-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--micro-batch", type=int, default=16, help="rows per padded forward")
    ap.add_argument("--systems", default="score,padded,vllm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model)
    prompts, completions = rows(args)
    useful = sum(map(len, completions))
    report = {"machine": machine_info(), "rollout": rollout_version(), "args": vars(args),
              "rows": len(prompts), "completion_tokens": useful,
              "prompt_tokens_distinct": sum(len(p) for p in prompts[:: args.group]), "runs": {}}
    print(report["machine"], "\n", report["rollout"], f"\n{len(prompts)} rows ({args.prompts} prompts x "
                                                      f"G={args.group}), "
          f"{report['prompt_tokens_distinct']} distinct prompt tokens, {useful} completion tokens")
    reference = None
    for name in args.systems.split(","):
        if name == "vllm" and not vllm_available():
            print("vllm: skipped (no", VLLM_PYTHON, ")")
            continue
        before = load()
        if name == "score":
            seconds, lps, extra = run_score(model, prompts, completions)
        elif name == "padded":
            seconds, lps, extra = run_padded(model, prompts, completions, args.micro_batch)
        else:
            seconds, lps, extra = run_vllm(model, prompts, completions, args.threads)
        after = load()
        if reference is None:
            reference = lps
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(lps, reference, strict=True))
        report["runs"][name] = dict(seconds=seconds, tok_s=useful / seconds, max_abs_diff_vs_first=diff,
                                    load_before=before, load_after=after, **extra)
        print(f"{name:7s} {seconds:7.2f} s {useful / seconds:9.0f} completion tok/s  max |diff| {diff:.2e}  {extra}\n"
              f"        load before: {before}\n        load after:  {after}")
    base = report["runs"].get("score")
    if base:
        for name, r in report["runs"].items():
            print(f"score vs {name}: {r['seconds'] / base['seconds']:.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
