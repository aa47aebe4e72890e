"""The importance-ratio bias of top-p / top-k sampling, with and without the engine's sampling masks (issue 57).

On the demo task (the GRPO demo's warm start, the addition task's prompts), the engine samples at temperature 1 with
top-p 0.8 and top-k 20 (non-invariant mode) and reports each token's logprob under the distribution it drew from
(processed logprobs) and its sampling mask. The trainer side then scores the same tokens under the same weights
(an on-policy step: the true ratio is 1) three ways:

- "full softmax": log_softmax(logits / T) at the token, what a trainer without the support computes (TRL #7269,
  vLLM #49577): its ratio is the kept mass S of each step, a log S bias;
- "sampling mask": log_softmax over the engine's mask only (`RolloutBatch.sampling_masks`);
- "recomputed truncation": the trainer's own top-k / top-p cut of its logits (`trainers.common.scored_logprobs`,
  what our trainers do by default).

Prints one JSON line per method: the mean ratio exp(new - old) over the generated tokens, the mean |log ratio|, and
the number of tokens.

    .venv/bin/python benchmarks/sampling_mask_ratio.py [--model DIR] [--prompts 64] [--group 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def default_model() -> str:
    cache = os.path.expanduser(os.environ.get("ROLLOUT_WARM_START_CACHE", "~/.cache/rollout/warm_starts"))
    found = sorted(glob.glob(os.path.join(cache, "addition3_*seed0*")))
    if not found:
        raise SystemExit(f"no demo warm start under {cache}: run the README's demo once, or pass --model")
    return found[0]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout import ContinuousBatchingConfig, RolloutEngine, SamplingParams
    from trainers.common import truncate_logits
    from trainers.tasks import AdditionTask

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top_p", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    path = args.model or default_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = AdditionTask(num_digits=3, seed=args.seed).sample(args.prompts)
    prompts = [tok(r["prompt"], add_special_tokens=True)["input_ids"] for r in rows]
    sp = SamplingParams(temperature=1.0, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=8,
                        return_sampling_mask=True)
    engine = RolloutEngine(model, tokenizer=tok, config=ContinuousBatchingConfig())
    start = time.perf_counter()
    try:
        batch = engine.generate(prompts, sampling=sp, group_size=args.group)
    finally:
        engine.close()
    gen_s = time.perf_counter() - start
    mask = batch.completion_mask.bool()  # [N, T]
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits.float()  # [N, P + T, V]
    p_len = batch.prompt_ids.shape[1]
    step = logits[:, p_len - 1:-1]  # [N, T, V]: the distribution each completion token was drawn from
    tokens = batch.completion_ids
    support = torch.zeros_like(step, dtype=torch.bool)  # [N, T, V]
    for n, row in enumerate(batch.sampling_masks):
        for t, ids in enumerate(row):
            support[n, t, ids] = True
    methods = {
        "full softmax": step.log_softmax(-1),
        "sampling mask": step.masked_fill(~support, float("-inf")).log_softmax(-1),
        "recomputed truncation": truncate_logits(step, tokens, args.top_k, args.top_p).log_softmax(-1),
    }
    old = batch.logprobs  # [N, T] the engine's processed logprobs
    for name, logp in methods.items():
        new = logp.gather(-1, tokens[..., None])[..., 0]  # [N, T]
        log_ratio = (new - old)[mask]
        print(json.dumps({"method": name, "mean_ratio": round(log_ratio.exp().mean().item(), 4),
                          "mean_abs_log_ratio": round(log_ratio.abs().mean().item(), 5),
                          "tokens": int(mask.sum()), "top_p": args.top_p, "top_k": args.top_k,
                          "kept_per_step": round(support[mask].sum(-1).float().mean().item(), 2),
                          "generate_s": round(gen_s, 2), "model": os.path.basename(path)}))


if __name__ == "__main__":
    main()
