"""Device check: what to run the first time a GPU is lent (driven by benchmarks/device_check.sh).

Given one CUDA device, within `--budget` seconds (default 420):
1. the `gpu`-marked tests (`pytest -m gpu`: flex on CUDA against `generate` and teacher forcing, no host
   sync in a flex step under `torch.cuda.set_sync_debug_mode("error")`, pinned CPU offload, flash refusal) and the
   `triton`-marked ones compiled (batch-invariant mode on CUDA among them);
1b. the batch-invariant mode's overhead against the default config (`invariant_overhead`);
2. a throughput comparison on a ~0.6B random-weight Qwen3-architecture model in bf16 (the RL workload
   of benchmarks/throughput.py, scaled up): ours (`attn_backend="flex"`, the CUDA default, and "sdpa")
   vs padded `model.generate` vs transformers' continuous batching (flash_attention_2 when flash-attn
   is installed, else sdpa), greedy agreement with unbatched `generate` on a subset, peak GPU memory
   and GPU memory left allocated after each system;
and writes everything to `--out` (JSON, rewritten after each part, so a run cut short keeps what it
measured) and the tests' whole output next to it (`*_tests.log`).

`--dry-run` runs the same driver on a CPU with a ~5M model, a tiny workload and no compile-heavy system,
lists the gpu tests it would run, and says what it would measure: CI runs it (tests/benchmarks/test_device_check.py).

On the lent machine (its image has torch and triton but an older transformers): first, here,
`bash benchmarks/device_wheels.sh`, then carry `.whl` (see that script's header for the install line).

    bash benchmarks/device_check.sh --out benchmarks/logs/gpu/device_check.json
    bash benchmarks/device_check.sh --dry-run --out /tmp/device_check.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Workload,
    compare,
    decode_workload,
    generate_one,
    greedy_config,
    rl_workload,
    run_generate,
    run_hf_cb,
    run_ours,
)
from benchmarks.gpu_systems import OURS, nano_workload  # noqa: E402
from rollout import ContinuousBatchingConfig  # noqa: E402

# ~0.6B: Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 heads, 8 KV heads, head size 128, vocab 151936)
GPU_MODEL = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
CPU_MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=False)
# (prompts, group, prompt lengths, completion lengths)
GPU_WORKLOAD = (32, 8, (64, 1024), (32, 512))
CPU_WORKLOAD = (2, 2, (8, 24), (2, 6))
# NOTE: the systems in the order they run; one that would start past the deadline is skipped (said so)
SYSTEM_ORDER = ("ours_async", "ours_static", "ours_flex", "generate", "hf_cb", "ours_sdpa", "ours_triton")
# NOTE: nano-vllm's workload (256 x 100-1024 in and out) runs ours only: padded generate would take minutes
NANO_ORDER = ("ours_async", "ours_async_seeded", "ours_static", "ours_flex")
SAMPLED = ("ours_async_seeded",)  # NOTE: sampled, seeded: tokens/s only, no greedy comparison


def make_model(spec: dict, dtype: torch.dtype, device: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(max_position_embeddings=4096, initializer_range=0.3, **spec)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).to(device).eval()


def environment() -> dict:
    import transformers

    cuda = torch.cuda.is_available()
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": _version("triton"),
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "threads": torch.get_num_threads(),
    }
    if cuda:
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


GPU_TEST_FILES = ("tests/model/test_gpu_async.py", "tests/invariant/test_triton_invariant.py",
                  "tests/model/test_gpu.py", "tests/kernels/test_triton_decode.py",
                  "tests/kernels/test_triton_prefill.py", "tests/kernels/test_triton_cascade.py",
                  "tests/attention/test_triton_backend.py", "tests/sampling/test_counter_seed.py")
# NOTE: the batch-invariant overhead's workload: 16 prompts x G=4, prompts 64-512, completions 64-256
INVARIANT_WORKLOAD = (16, 4, (64, 512), (64, 256))
INVARIANT_ORDER = ("invariant", "default", "triton")  # NOTE: the mode, the CUDA default (flex), the triton backend


def gpu_tests(dry_run: bool, timeout: float, log: str) -> dict:
    """Run (or, dry, only collect) the `gpu`-marked tests; their whole output goes to `log` as they run
    (`-v`: a run cut short still says which tests passed)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu or triton", *GPU_TEST_FILES, "-rA", "--tb=short",
           "--durations=5", "-p", "no:cacheprovider"]
    if dry_run:
        cmd.insert(4, "--collect-only")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    with open(log) as f:
        text = f.read() + (f"\ntimed out after {timeout:.0f} s" if rc == -1 else "")
    lines = text.splitlines()
    return {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": round(time.perf_counter() - t0, 1),
            "results": [ln for ln in lines if ln.startswith(GPU_TEST_FILES) and "::" in ln][:120],
            "tail": lines[-40:]}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    if device != "cuda":
        return 0
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # NOTE: torch's per-handle cuBLAS workspaces (a thread's first matmul)
    return torch.cuda.memory_allocated()


def exactness_fp32(spec: dict, wl: Workload, ref_idx: list[int], device: str) -> dict:
    """Greedy tokens of ours (the device's default backend) on the whole workload in fp32 against
    unbatched `generate` of `ref_idx`: at bf16 a random deep model's near-ties make every batched
    system (padded `generate` too) drift from the unbatched one within a few tokens, so exactness is
    judged in fp32, on the same shapes (layers, heads, head size, page size) and requests."""
    t0 = time.perf_counter()
    model = make_model(spec, torch.float32, device, "sdpa")
    ref = [generate_one(model, wl.prompts[i], wl.max_new[i]) for i in ref_idx]
    r = run_ours(model, wl)
    exact, prefix = compare([r.outputs[i] for i in ref_idx], ref)
    del model
    return {"requests": ref_idx, "greedy_exact_vs_generate": exact, "greedy_prefix_vs_generate": round(prefix, 3),
            "seconds": round(time.perf_counter() - t0, 1)}


def throughput(dry_run: bool, device: str, deadline: float, save, names=SYSTEM_ORDER, fp32_check=True,
               nano: bool = False) -> dict:
    """Each system on the same model and requests; tokens/s of useful tokens, greedy agreement first.
    `nano`: nano-vllm's workload (`benchmarks.gpu_systems.nano_workload`) instead of the RL one.

    `save(partial)` is called after each system, so a run cut short still leaves its numbers."""

    spec, dtype = (CPU_MODEL, torch.float32) if dry_run else (GPU_MODEL, torch.bfloat16)
    n_prompts, group, plen, clen = CPU_WORKLOAD if dry_run else GPU_WORKLOAD
    flash = importlib.util.find_spec("flash_attn") is not None and not dry_run
    hf_attn = "flash_attention_2" if flash else "sdpa"
    model = make_model(spec, dtype, device, hf_attn)
    if nano:
        wl = nano_workload(spec["vocab_size"], *((4, (4, 12)) if dry_run else ()))
        group = 1
    else:
        wl = rl_workload(n_prompts, group, spec["vocab_size"], plen, clen)
    out = {"model": {**spec, "dtype": str(dtype), "params": sum(p.numel() for p in model.parameters())},
           "workload": wl.describe(), "systems": {}}
    # NOTE: the oracle is unbatched `generate` of a few requests (each costs its completion's steps)
    # NOTE: two requests of each of the first two groups (shared prompt, different lengths)
    ref_idx = [0, 1] if dry_run else [0, 1, group, group + 1]
    if fp32_check:
        try:
            out["exactness_fp32"] = exactness_fp32(spec, wl, ref_idx, device)
        except Exception as e:  # NOTE: reported, and the throughput part still runs
            out["exactness_fp32"] = {"error": f"{type(e).__name__}: {e}"[:800],
                                     "traceback": traceback.format_exc().splitlines()[-12:]}
        print("exactness_fp32", out["exactness_fp32"], flush=True)
        save(out)
    t0 = time.perf_counter()
    ref = [generate_one(model, wl.prompts[i], wl.max_new[i]) for i in ref_idx]
    out["oracle"] = {"requests": ref_idx, "seconds": round(time.perf_counter() - t0, 1)}
    warm = Workload([wl.prompts[i] for i in ref_idx[:2]], [min(8, wl.max_new[i]) for i in ref_idx[:2]], 1)
    systems = {
        # NOTE: flex compiles ~20-40 s on a CPU: the dry run uses sdpa only
        "ours_flex": None if dry_run else (lambda m, w: run_ours(m, w, ContinuousBatchingConfig(attn_backend="flex"))),
        "generate": run_generate,
        "hf_cb": run_hf_cb,
        "ours_sdpa": lambda m, w: run_ours(m, w, ContinuousBatchingConfig(attn_backend="sdpa")),
        # NOTE: the Triton kernel runs on CUDA only (on a CPU under the interpreter: too slow for a dry run)
        **{name: None if dry_run else fn for name, fn in OURS.items() if name != "ours_flex"},
    }
    for name in names:
        fn = systems[name]
        if fn is None:
            continue
        left = deadline - time.perf_counter()
        if left < 45:
            out["systems"][name] = {"skipped": f"{left:.0f} s left before the deadline"}
            print(name, out["systems"][name], flush=True)
            continue
        entry: dict = {}
        base_mem = _allocated(device)
        try:
            t0 = time.perf_counter()
            fn(model, warm)  # NOTE: warm-up (compiles, allocator) on two short requests
            _sync(device)
            entry["warmup_s"] = round(time.perf_counter() - t0, 1)
            r = fn(model, wl)
            _sync(device)
            entry.update({"seconds": round(r.seconds, 3), "tokens_per_s": round(wl.useful_tokens / r.seconds, 1)})
            if name not in SAMPLED:
                exact, prefix = compare([r.outputs[i] for i in ref_idx], ref)
                entry.update({"greedy_exact_vs_generate": exact, "greedy_prefix_vs_generate": round(prefix, 3)})
            entry.update({k: v for k, v in r.extra.items() if k in ("steps", "overlapped")})
            if device == "cuda":
                entry["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                torch.cuda.reset_peak_memory_stats()
        except Exception as e:  # NOTE: one failing system must not hide the others' numbers
            entry["error"] = f"{type(e).__name__}: {e}"[:800]
            entry["traceback"] = traceback.format_exc().splitlines()[-12:]
        entry["leaked_bytes"] = _allocated(device) - base_mem  # NOTE: this system's, once its objects are gone
        out["systems"][name] = entry
        print(name, entry, flush=True)
        save(out)
    base = out["systems"].get("generate", {}).get("tokens_per_s")
    for entry in out["systems"].values():
        if base and "tokens_per_s" in entry:
            entry["vs_generate"] = round(entry["tokens_per_s"] / base, 2)
    return out


def invariant_overhead(dry_run: bool, device: str, deadline: float, save) -> dict:
    """What `batch_invariant=True` costs on this device: useful tok/s of ours with the mode (on CUDA: its Triton
    GEMMs, RMSNorm and per-row attention) against the default config and `attn_backend='triton'`, on one bf16 model
    and RL workload (each system warmed on two short requests first), and whether the mode's request 0 is bitwise
    the same (tokens and logprobs) run alone as in the batch; `slowdown` = the mode's seconds / the other's - 1
    (anchors: SGLang's deterministic mode 34%, vLLM's batch-invariant mode +111-127%; the target is <= 35%)."""
    from rollout.engine.core import EngineCore

    spec, dtype = (CPU_MODEL, torch.float32) if dry_run else (GPU_MODEL, torch.bfloat16)
    n_prompts, group, plen, clen = CPU_WORKLOAD if dry_run else INVARIANT_WORKLOAD
    model = make_model(spec, dtype, device, "sdpa")
    wl = rl_workload(n_prompts, group, spec["vocab_size"], plen, clen, seed=1)
    configs = {"invariant": dict(batch_invariant=True), "default": {}, "triton": dict(attn_backend="triton")}
    if dry_run:  # NOTE: the CPU's default; Triton runs interpreted there (too slow)
        configs["triton"] = None
    out: dict = {"workload": wl.describe(), "dtype": str(dtype), "systems": {}}

    def run(fields: dict, prompts, max_new) -> tuple[float, list]:
        core = EngineCore(model, greedy_config(), ContinuousBatchingConfig(return_logprobs=True, **fields))
        reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=n)
                for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
        t0 = time.perf_counter()
        for r in reqs:
            core.add(r)
        while core.has_work():
            core.step()
        _sync(device)
        return time.perf_counter() - t0, [r.to_output() for r in reqs]

    batch = None
    for name in INVARIANT_ORDER:
        fields = configs[name]
        if fields is None:
            continue
        if deadline - time.perf_counter() < 45:
            out["systems"][name] = {"skipped": f"{deadline - time.perf_counter():.0f} s left before the deadline"}
            continue
        try:
            warm = run(fields, [p[:16] for p in wl.prompts[:2]], [8, 8])[0]
            seconds, outs = run(fields, wl.prompts, wl.max_new)
            out["systems"][name] = {"warmup_s": round(warm, 1), "seconds": round(seconds, 3),
                                    "tokens_per_s": round(wl.useful_tokens / seconds, 1)}
            if name == "invariant":
                batch = outs
        except Exception as e:  # NOTE: reported; the other systems still run
            out["systems"][name] = {"error": f"{type(e).__name__}: {e}"[:800],
                                    "traceback": traceback.format_exc().splitlines()[-12:]}
        print("invariant_overhead", name, out["systems"][name], flush=True)
        save(out)
    inv = out["systems"].get("invariant", {}).get("seconds")
    for name in INVARIANT_ORDER[1:]:
        other = out["systems"].get(name, {}).get("seconds")
        if inv and other:
            out[f"slowdown_vs_{name}"] = round(inv / other - 1, 3)
    if batch is not None and deadline - time.perf_counter() > 20:
        alone = run(configs["invariant"], wl.prompts[:1], wl.max_new[:1])[1][0]
        out["request0_alone_equals_batch"] = {
            "tokens": alone.generated_tokens == batch[0].generated_tokens,
            "logprobs": alone.logprobs == batch[0].logprobs}
    save(out)
    return out


def step_profile(dry_run: bool, device: str, steps: int = 20, cbc: ContinuousBatchingConfig | None = None) -> dict:
    """Where a decode step's time goes: `steps` steady decode steps of ours (default backend) under
    torch.profiler. On CUDA, GPU-busy time (the sum of kernel times) against the wall clock says whether
    the step is bound by the host (Python, launches) or by the device; the top ops say by what."""
    from torch.profiler import ProfilerActivity, profile

    from rollout.engine.core import EngineCore

    spec, dtype = (CPU_MODEL, torch.float32) if dry_run else (GPU_MODEL, torch.bfloat16)
    model = make_model(spec, dtype, device, "sdpa")
    wl = decode_workload(4 if dry_run else 64, spec["vocab_size"], prompt_len=32 if dry_run else 256,
                         new_tokens=steps + 8)
    core = EngineCore(model, greedy_config(), cbc or ContinuousBatchingConfig())
    for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True)):
        core.add(core.make_request(p, request_id=f"p{i}", max_new_tokens=n))
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    for _ in range(3):  # NOTE: warm (compiles for the decode shape)
        core.step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            core.step()
        _sync(device)
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    out = {"backend": core.backend.name, "rows": len(core.scheduler.running), "steps": steps,
           "wall_ms_per_step": round(1e3 * wall, 2),
           "top_cpu_ops": [(e.key, round(e.self_cpu_time_total / 1e3 / steps, 3)) for e in
                           sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]]}
    if device == "cuda":
        busy = sum(e.self_device_time_total for e in events) / 1e3 / steps
        out["gpu_busy_ms_per_step"] = round(busy, 2)
        out["gpu_busy_share"] = round(busy / (1e3 * wall), 3)
        out["top_cuda_kernels"] = [(e.key[:80], round(e.self_device_time_total / 1e3 / steps, 3)) for e in
                                   sorted(events, key=lambda e: -e.self_device_time_total)[:12]]
    del core
    return out


PLAN = [
    "gpu tests: pytest -m 'gpu or triton' (issue 61 first: the counter-based generator's words on CUDA equal the "
    "CPU's, seeded fp32 tokens on CUDA equal the CPU's, use_async_batching equal to the synchronous engine on "
    "triton+graphs and flex, a steady overlapped step under set_sync_debug_mode('error'); batch-invariant mode on CUDA "
    "(a row bitwise the same alone and in a 48-row bf16 batch, the default differing; trainer == engine bitwise, "
    "the Triton GEMM / RMSNorm rows invariant, compiled); then flex kernel vs fp64; "
    "flex/sdpa/triton on CUDA exact vs generate and teacher forcing; the Triton decode kernel compiled, vs the C++ "
    "kernel and fp64; no host sync in a flex step; pinned CPU offload under pressure; flash refuses without "
    "flash-attn; the RL loop update/sleep/wake/close, also with triton and use_cuda_graph=True; seeded sampling; the "
    "GRPO trainer colocated on the GPU)",
    "exactness, ~0.6B Qwen3-arch random weights, fp32: ours (default backend) on the whole workload below, "
    "greedy tokens of 4 requests (2 groups) against unbatched generate",
    "throughput, same model in bf16, 32 prompts x G=8 (prompts 64-1024, completions 32-512): ours async (triton, "
    "use_cuda_graph=True, use_async_batching=True), ours static (the same, synchronous), ours flex, "
    "padded generate, transformers CB (flash_attention_2 or sdpa), "
    "ours sdpa, ours triton; useful tok/s, greedy agreement with unbatched generate (bf16: informative only), "
    "peak and leaked GPU memory",
    "batch-invariant overhead, same bf16 model, 16 prompts x G=4 (prompts 64-512, completions 64-256): ours with "
    "batch_invariant=True (on CUDA its Triton GEMMs, RMSNorm and per-row attention) vs the default config and vs "
    "attn_backend='triton': useful tok/s, slowdown (target <= 35%; SGLang 34%, vLLM +111-127%), and request 0 run "
    "alone bitwise equal (tokens, logprobs) to itself in the batch",
    "nano-vllm's workload, same bf16 model, 256 sequences, input and output lengths uniform 100-1024, no EOS: "
    "ours async (greedy), ours async seeded (T=0.6, a seed per request: the counter stream), ours static, "
    "ours flex (tok/s of generated tokens)",
    "step profile, same bf16 model, 64 requests decoding: wall ms per step against GPU-busy ms (host or "
    "device bound?), top CPU ops and CUDA kernels per step; default backend, then triton+graphs asynchronous "
    "and synchronous",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, no gpu tests run (collected only)")
    ap.add_argument("--out", default="benchmarks/logs/gpu/device_check.json")
    ap.add_argument("--test-timeout", type=float, default=190.0, help="seconds for the gpu tests")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds for the whole check: a system that would start in its last 45 s is skipped")
    ap.add_argument("--skip-tests", action="store_true", help="throughput only")
    ap.add_argument("--systems", default=",".join(SYSTEM_ORDER), help=f"of {','.join(SYSTEM_ORDER)}, run in this order")
    ap.add_argument("--no-fp32-check", action="store_true", help="skip the fp32 exactness run")
    ap.add_argument("--no-nano", dest="nano", action="store_false", help="skip nano-vllm's workload (256 x 100-1024)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the step profile")
    ap.add_argument("--no-invariant", dest="invariant", action="store_false",
                    help="skip the batch-invariant overhead")
    args = ap.parse_args()
    t_start = time.perf_counter()
    deadline = t_start + args.budget
    env = environment()
    if not args.dry_run and not env["cuda"]:
        sys.exit("device_check: no CUDA device here; use --dry-run")
    device = "cpu" if args.dry_run else "cuda"
    print("device_check:", "DRY RUN on CPU:" if args.dry_run else "", env, flush=True)
    print("would measure:" if args.dry_run else "measuring:", *PLAN, sep="\n  - ", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result: dict = {"dry_run": args.dry_run, "environment": env, "plan": PLAN}

    def save(partial: dict | None = None) -> None:
        if partial is not None:
            result["throughput"] = partial
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if not args.skip_tests:
        log = os.path.splitext(args.out)[0] + "_tests.log"
        result["gpu_tests"] = gpu_tests(args.dry_run, min(args.test_timeout, max(30.0, args.budget / 2)), log)
        print("gpu tests:", *result["gpu_tests"]["results"], *result["gpu_tests"]["tail"][-3:], sep="\n  ", flush=True)
        save()
    names = [n for n in args.systems.split(",") if n]
    unknown = sorted(set(names) - set(SYSTEM_ORDER))
    if unknown:
        sys.exit(f"device_check: unknown --systems {unknown}; choose from {SYSTEM_ORDER}")

    def profile(key: str, **fields) -> None:
        if not args.profile or deadline - time.perf_counter() < 30 or (fields and args.dry_run):
            return
        try:  # NOTE: reported; the numbers measured before are kept
            cbc = ContinuousBatchingConfig(attn_backend="triton", use_cuda_graph=True, **fields) if fields else None
            result[key] = step_profile(args.dry_run, device, cbc=cbc)
        except Exception as e:
            result[key] = {"error": f"{type(e).__name__}: {e}"[:800],
                           "traceback": traceback.format_exc().splitlines()[-12:]}
        print(key, result[key], flush=True)
        save()

    # NOTE: what issue 61 must show comes first (a run cut short keeps it): the batch-invariant overhead, nano-vllm's
    # workload, the GPU-busy share of asynchronous static decode steps, then the RL comparison and the other profiles
    if args.invariant:
        def save_invariant(partial: dict) -> None:
            result["invariant_overhead"] = partial
            save()

        save_invariant(invariant_overhead(args.dry_run, device, deadline, save_invariant))
    if args.nano:
        def save_nano(partial: dict) -> None:
            result["nano_vllm_workload"] = partial
            save()

        nano_names = ("ours_sdpa",) if args.dry_run else NANO_ORDER
        save_nano(throughput(args.dry_run, device, deadline, save_nano, nano_names, fp32_check=False, nano=True))
    profile("step_profile_async", use_async_batching=True)
    save(throughput(args.dry_run, device, deadline, save, names, fp32_check=not args.no_fp32_check))
    profile("step_profile")
    profile("step_profile_static", use_async_batching=False)
    print(f"device_check: wrote {args.out} in {result['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
