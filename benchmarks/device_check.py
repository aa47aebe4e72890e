"""Device check: what to run the first time a GPU is lent (driven by benchmarks/device_check.sh).

Given one CUDA device, within ~8 minutes:
1. the `gpu`-marked tests (`pytest -m gpu`: flex on CUDA against `generate` and teacher forcing, no host
   sync in a flex step under `torch.cuda.set_sync_debug_mode("error")`, pinned CPU offload, flash refusal);
2. a throughput comparison on a ~0.5B random-weight Qwen3-architecture model in bf16 (the RL workload
   of benchmarks/throughput.py, scaled up): ours (`attn_backend="flex"`, the CUDA default, and "sdpa")
   vs padded `model.generate` vs transformers' continuous batching (flash_attention_2 when flash-attn
   is installed, else sdpa), greedy agreement with `generate` on a subset first;
and writes everything to `--out` (JSON next to a Markdown summary).

`--dry-run` runs the same driver on a CPU with a ~5M model, a tiny workload and no compile-heavy system,
lists the gpu tests it would run, and says what it would measure: CI runs it (tests/test_device_check.py).

    bash benchmarks/device_check.sh --out benchmarks/logs/device_check.json
    bash benchmarks/device_check.sh --dry-run --out /tmp/device_check.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from benchmarks.common import compare, generate_one, rl_workload, run_generate, run_hf_cb, run_ours  # noqa: E402

# ~0.6B: Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 heads, 8 KV heads, head size 128, vocab 151936)
GPU_MODEL = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
CPU_MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=False)
# (prompts, group, prompt lengths, completion lengths)
GPU_WORKLOAD = (64, 8, (64, 1024), (32, 512))
CPU_WORKLOAD = (2, 2, (8, 24), (2, 6))


def make_model(spec: dict, dtype: torch.dtype, device: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(max_position_embeddings=4096, initializer_range=0.3, **spec)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).to(device).eval()


def environment() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "threads": torch.get_num_threads(),
    }


def gpu_tests(dry_run: bool, timeout: float) -> dict:
    """Run (or, dry, only collect) the `gpu`-marked tests."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"]
    if dry_run:
        cmd.insert(4, "--collect-only")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        tail, rc = (p.stdout + p.stderr).strip().splitlines()[-40:], p.returncode
    except subprocess.TimeoutExpired:
        tail, rc = ["timed out"], -1
    return {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": round(time.perf_counter() - t0, 1),
            "tail": tail}


def throughput(dry_run: bool, device: str) -> dict:
    """Each system on the same model and requests; tokens/s of useful tokens, greedy agreement first."""
    from rollout import ContinuousBatchingConfig

    spec, dtype = (CPU_MODEL, torch.float32) if dry_run else (GPU_MODEL, torch.bfloat16)
    n_prompts, group, plen, clen = CPU_WORKLOAD if dry_run else GPU_WORKLOAD
    flash = importlib.util.find_spec("flash_attn") is not None and not dry_run
    hf_attn = "flash_attention_2" if flash else "sdpa"
    model = make_model(spec, dtype, device, hf_attn)
    wl = rl_workload(n_prompts, group, spec["vocab_size"], plen, clen)
    backends = ["sdpa"] if dry_run else ["flex", "sdpa"]  # NOTE: flex compiles ~20-40 s on a CPU: not in CI
    systems = {f"ours_{b}": (lambda m, w, b=b: run_ours(m, w, ContinuousBatchingConfig(attn_backend=b)))
               for b in backends}
    systems["generate"] = run_generate
    systems[f"hf_cb_{hf_attn}"] = run_hf_cb
    out = {"model": {**spec, "dtype": str(dtype), "params": sum(p.numel() for p in model.parameters())},
           "workload": wl.describe(), "systems": {}}
    ref_idx = list(range(0, wl.num_requests, max(1, wl.num_requests // 8)))[:2 if dry_run else 8]
    ref = [generate_one(model, wl.prompts[i], wl.max_new[i]) for i in ref_idx]
    for name, fn in systems.items():
        entry: dict = {}
        try:
            fn(model, wl.subset(ref_idx[:2]))  # NOTE: warm-up (compiles, allocator) on two requests
            if device == "cuda":
                torch.cuda.synchronize()
            r = fn(model, wl)
            entry = {"seconds": round(r.seconds, 3), "tokens_per_s": round(wl.useful_tokens / r.seconds, 1),
                     "greedy_match_vs_generate": compare([r.outputs[i] for i in ref_idx], ref)[0]}
        except Exception as e:  # NOTE: one failing system must not hide the others' numbers
            entry = {"error": f"{type(e).__name__}: {e}"[:500]}
        out["systems"][name] = entry
        print(name, entry, flush=True)
    base = out["systems"].get("generate", {}).get("tokens_per_s")
    for entry in out["systems"].values():
        if base and "tokens_per_s" in entry:
            entry["vs_generate"] = round(entry["tokens_per_s"] / base, 2)
    return out


PLAN = [
    "gpu tests: pytest -m gpu (flex on CUDA exact vs generate and teacher forcing; no host sync in a flex "
    "step; pinned CPU offload under pressure; flash refuses without flash-attn)",
    "throughput, ~0.6B Qwen3-arch random weights, bf16, 64 prompts x G=8 (prompts 64-1024, completions "
    "32-512): ours flex, ours sdpa, padded generate, transformers CB (flash_attention_2 or sdpa); useful tok/s "
    "and greedy agreement with unbatched generate on a subset",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, no gpu tests run (collected only)")
    ap.add_argument("--out", default="benchmarks/logs/device_check.json")
    ap.add_argument("--test-timeout", type=float, default=240.0)
    args = ap.parse_args()
    env = environment()
    if not args.dry_run and not env["cuda"]:
        sys.exit("device_check: no CUDA device here; use --dry-run")
    device = "cpu" if args.dry_run else "cuda"
    print("device_check:", "DRY RUN on CPU:" if args.dry_run else "", env, flush=True)
    print("would measure:" if args.dry_run else "measuring:", *PLAN, sep="\n  - ", flush=True)
    t0 = time.perf_counter()
    result = {"dry_run": args.dry_run, "environment": env, "plan": PLAN,
              "gpu_tests": gpu_tests(args.dry_run, args.test_timeout),
              "throughput": throughput(args.dry_run, device)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"device_check: wrote {args.out} in {result['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
