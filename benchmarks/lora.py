"""What serving LoRA adapters unmerged costs, and what an adapter-only sync saves.

One process, one base model (`common.make_model`, a random Qwen3-architecture model), adapters of rank `--rank`
on every linear layer (LoRA Without Regret's setting; PEFT, B drawn non-zero). Four engines on the same prompts,
greedy, `--new` tokens each, timed in turns (`--runs`, medians):

- `merged`: an engine on a copy of the base with adapter 0 merged in (`merge_and_unload`): the cost of the
  base model itself, what a merged-per-adapter deployment runs at;
- `1 adapter`: the base engine with adapter 0 unmerged, every row under it;
- `4 adapters`: the same engine with 4 adapters, the rows split evenly among them in one call;
- `base`: the same engine, no adapter (the unmerged path's cost when a step has no adapter row).

The 1-adapter rows' tokens are checked against the merged engine's (the same function, rounded otherwise:
near-ties may differ, reported as a match count). Then a sync: `update_lora` with the adapter's state dict
(bytes and seconds) against `update_weights` with the whole merged model's state dict.

    python benchmarks/lora.py [--size 100m] [--rank 16] [--prompts 32] [--new 64] [--runs 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_model  # noqa: E402

from rollout import ContinuousBatchingConfig, RolloutEngine  # noqa: E402


def make_adapters(base, n: int, rank: int):
    from peft import LoraConfig, get_peft_model

    out = []
    for i in range(n):
        m = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                             lora_dropout=0.0))
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.02 if "lora_B" in name else 1 / p.shape[1] ** 0.5))
        out.append(m.eval())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="100m")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base = make_model(a.size)
    adapters = make_adapters(base, 4, a.rank)
    merged = copy.deepcopy(adapters[0]).merge_and_unload()
    gc = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=a.new)
    cfg = ContinuousBatchingConfig(max_loras=4, max_lora_rank=a.rank, page_size=16)
    g = torch.Generator().manual_seed(0)
    vocab = base.config.vocab_size
    prompts = [torch.randint(1, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    names = [f"a{i}" for i in range(4)]
    engine = RolloutEngine(base, config=cfg, generation_config=gc)
    for name, adapter in zip(names, adapters, strict=True):
        engine.add_lora(name, adapter)
    merged_engine = RolloutEngine(merged, config=cfg.replace(max_loras=0), generation_config=gc)
    runs = {
        "merged": lambda: merged_engine.generate(prompts, temps=0.0),
        "1 adapter": lambda: engine.generate(prompts, temps=0.0, lora="a0"),
        "4 adapters": lambda: engine.generate(prompts, temps=0.0, lora=[names[i % 4] for i in range(len(prompts))]),
        "base": lambda: engine.generate(prompts, temps=0.0),
    }
    outs = {k: fn() for k, fn in runs.items()}  # NOTE: warm-up (kernels, packed weights)
    same = sum(torch.equal(x, y) for x, y in zip(outs["merged"].completion_ids, outs["1 adapter"].completion_ids,
                                                  strict=True))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.runs):
        for k, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    tokens = a.prompts * a.new
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()[0]
    print(f"{a.size} fp32, rank {a.rank} on every linear, {a.prompts} prompts x {a.prompt_len} tokens, {a.new} new, "
          f"{a.threads} thread(s), medians of {a.runs}, load {load:.1f}")
    for k, v in tps.items():
        print(f"  {k:11s} {v:8.1f} tok/s   merged / this: {tps['merged'] / v:.3f}x")
    print(f"  greedy rows equal to the merged engine's: {same}/{a.prompts} (1 adapter)")

    from peft import get_peft_model_state_dict

    state, lcfg = get_peft_model_state_dict(adapters[1]), adapters[1].peft_config["default"]
    full = merged.state_dict()
    sync = {}
    for label, fn, nbytes in (
        ("adapter-only (update_lora)", lambda: engine.update_lora("a0", state, config=lcfg),
         sum(t.numel() * t.element_size() for t in state.values())),
        ("full (update_weights)", lambda: merged_engine.update_weights(full),
         sum(t.numel() * t.element_size() for t in full.values())),
    ):
        fn()
        ts = []
        for _ in range(max(a.runs, 3)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        sync[label] = (nbytes, statistics.median(ts))
        print(f"  sync {label:27s} {nbytes / 2**20:8.1f} MiB  {statistics.median(ts) * 1e3:8.1f} ms")
    (ab, at), (fb, ft) = sync.values()
    print(f"  adapter-only sync: {fb / ab:.0f}x fewer bytes, {ft / at:.1f}x faster")
    engine.close()
    merged_engine.close()
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "tok_s": tps, "times": times, "same": same,
                                            "sync": sync, "load": load}, indent=1))


if __name__ == "__main__":
    main()
