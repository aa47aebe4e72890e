"""Where ours spends its time: phase timers, torch.profiler ops, cProfile, and (optionally) py-spy.

Two workloads on the 5M (or --model 100m) Qwen3-arch model, default `ContinuousBatchingConfig()`:
  rl      the quick throughput workload (8 prompts x G=4, prompts 16-512, completions 8-256), whole run;
  decode  64 concurrent requests, prompt 256, 128 new tokens; only the steps after every request has
          finished its prompt are measured (pure decode).
  long    16 concurrent requests, prompt 900, 128 new tokens, pure decode as above (long contexts, #26).
  tail    4 concurrent requests, prompt 200, 128 new tokens, pure decode: an RL step's few-row tail (#60).

Passes (each on a fresh engine, after a warm-up run):
  phases  perf_counter around scheduler.schedule / runner.prepare / model forward (attention function
          apart) / sampler / scheduler.after_step / the rest of EngineCore.step. Lowest overhead.
  ops     torch.profiler, self CPU time per aten op (with phase labels as record_function ranges).
  py      cProfile, top functions by own time (inflates small Python functions: read with care).
  pyspy   `py-spy record` of this script in `--only` mode, lines by own samples inside EngineCore.step
          (run with --pyspy; needs py-spy installed).

    python benchmarks/profile_ours.py                   # both workloads, phases + ops + cProfile
    python benchmarks/profile_ours.py --pyspy           # + py-spy line-level sampling
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import decode_workload, greedy_config, make_model, rl_workload  # noqa: E402


class Timers:
    """CPU time of the calling thread per phase (`total`), and wall time (`wall`).

    With one intra-op thread all the work of a step runs on the calling thread, so its CPU time is what
    the step costs; the wall clock also counts the time spent waiting for a core on a busy box.
    """

    def __init__(self) -> None:
        self.total = collections.defaultdict(float)
        self.wall = collections.defaultdict(float)
        self.count = collections.Counter()

    @contextlib.contextmanager
    def __call__(self, name: str, label: bool = False):
        rf = torch.profiler.record_function(name) if label else contextlib.nullcontext()
        c0, t0 = time.thread_time(), time.perf_counter()
        with rf:
            yield
        self.total[name] += time.thread_time() - c0
        self.wall[name] += time.perf_counter() - t0
        self.count[name] += 1


def make_core(model):
    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    return EngineCore(model, greedy_config(), ContinuousBatchingConfig())


def add_all(core, wl) -> None:
    for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True)):
        core.add(core.make_request(p, request_id=f"req_{i}", max_new_tokens=n))


def prefill_until_decoding(core) -> int:
    """Step until every live request is decoding (so what follows is pure decode)."""
    from rollout.requests import RequestStatus

    steps = 0
    while core.has_work() and (core.scheduler.waiting or any(
            r.status != RequestStatus.DECODING for r in core.scheduler.running)):
        core.step()
        steps += 1
    return steps


def instrument(core, timers: Timers, label: bool = False) -> None:
    """Wrap the phases of one engine step with timers (instance attributes only; rollout/ is untouched)."""
    from transformers import AttentionInterface

    from rollout.attention import interface as attn_mod

    def wrap(obj, attr, name):
        fn = getattr(obj, attr)

        def wrapped(*a, **k):
            with timers(name, label):
                return fn(*a, **k)

        setattr(obj, attr, wrapped)

    wrap(core, "step", "step (total)")
    wrap(core.scheduler, "schedule", "scheduler.schedule")
    wrap(core.scheduler, "after_step", "scheduler.after_step")
    wrap(core.runner, "prepare", "runner.prepare")
    model = core.runner.forward  # NOTE: what `ModelRunner.execute` calls (the view, or its compiled forward)

    def forward(*a, **k):
        with timers("model forward (incl. attention)", label):
            return model(*a, **k)

    core.runner.forward = forward
    sampler = core.sampler

    class TimedSampler:
        def __call__(self, *a, **k):
            with timers("sampler", label):
                return sampler(*a, **k)

        def __getattr__(self, name):
            return getattr(sampler, name)

    core.sampler = TimedSampler()
    base_attn = attn_mod.paged_attention_forward

    def timed_attention(*a, **k):
        with timers("paged_attention_forward", label):
            return base_attn(*a, **k)

    AttentionInterface.register(attn_mod.ATTN_NAME, timed_attention)


def uninstrument_attention() -> None:
    from rollout.attention import interface as attn_mod

    attn_mod.register()


def run_measured(model, wl, kind: str, before=None, after=None):
    """Build a fresh engine, skip the prompt phase when kind == 'decode', run the rest between hooks."""
    core = make_core(model)
    add_all(core, wl)
    if kind == "decode":
        prefill_until_decoding(core)
    if before:
        before(core)
    t0 = time.perf_counter()
    steps, tokens0 = 0, core.stats["generated_tokens"]
    while core.has_work():
        core.step()
        steps += 1
    dt = time.perf_counter() - t0
    if after:
        after(core)
    return dt, steps, core.stats["generated_tokens"] - tokens0


def phases_pass(model, wl, kind: str) -> str:
    timers = Timers()
    dt, steps, toks = run_measured(model, wl, kind, before=lambda c: instrument(c, timers))
    uninstrument_attention()
    total = timers.total["step (total)"]
    fwd = timers.total["model forward (incl. attention)"]
    attn = timers.total["paged_attention_forward"]
    rows = [
        ("scheduler.schedule", timers.total["scheduler.schedule"]),
        ("runner.prepare (Python lists -> tensors, metadata)", timers.total["runner.prepare"]),
        ("model forward without attention (HF modules: linears, norms, RoPE, head)", fwd - attn),
        ("paged_attention_forward (cache write, gathers, SDPA)", attn),
        ("sampler (log_softmax, argmax, tolist)", timers.total["sampler"]),
        ("scheduler.after_step", timers.total["scheduler.after_step"]),
    ]
    known = sum(t for _, t in rows)
    rows.append(("rest of EngineCore.step (append_token, finalize, execute glue)", total - known))
    out = io.StringIO()
    print(f"{steps} steps, {toks} tokens; CPU {total:.2f} s = {toks / total:,.0f} tok/s, {1e3 * total / steps:.2f} "
          f"ms/step (wall {dt:.2f} s, {toks / dt:,.0f} tok/s); percentages of the step's CPU time:", file=out)
    for name, t in rows:
        print(f"  {100 * t / total:5.1f}%  {1e3 * t / steps:7.3f} ms/step  {name}", file=out)
    print(f"  attention calls per step: {timers.count['paged_attention_forward'] / max(steps, 1):.0f} "
          f"({1e6 * attn / max(timers.count['paged_attention_forward'], 1):.0f} us each)", file=out)
    return out.getvalue()


def ops_pass(model, wl, kind: str, top: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
    timers = Timers()

    def before(core):
        instrument(core, timers, label=True)
        prof.__enter__()

    run_measured(model, wl, kind, before=before, after=lambda c: prof.__exit__(None, None, None))
    uninstrument_attention()
    ka = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ka)
    out = io.StringIO()
    print(f"torch.profiler, self CPU time per op (total {total / 1e6:.2f} s, profiler overhead included):", file=out)
    for e in sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        print(f"  {100 * e.self_cpu_time_total / total:5.1f}%  {e.self_cpu_time_total / 1e3:9.1f} ms  "
              f"{e.count:8d} calls  {e.key}", file=out)
    return out.getvalue()


def cprofile_pass(model, wl, kind: str, top: int = 30) -> str:
    pr = cProfile.Profile()
    run_measured(model, wl, kind, before=lambda c: pr.enable(), after=lambda c: pr.disable())
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(top)
    lines = s.getvalue().splitlines()
    # keep the header line with the total and the table
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    head = [line for line in lines[:start] if "function calls" in line]
    return "\n".join(["cProfile, by own time (tottime):", *head, *lines[start:]]) + "\n"


def pyspy_pass(kind: str, args, top: int = 30) -> str:
    """Sample a child run of this script with py-spy; aggregate lines inside EngineCore.step."""
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        exe = "py-spy"
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "raw.txt")
        cmd = [exe, "record", "--rate", "250", "--format", "raw", "-o", raw, "--", sys.executable,
               os.path.abspath(__file__), "--only", kind, "--threads", str(args.threads), "--dtype", args.dtype,
               "--model", args.model, "--prompts", str(args.prompts)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(raw):
            return f"py-spy failed: {proc.stderr[-500:]}\n"
        self_lines, incl_funcs = collections.Counter(), collections.Counter()
        total = 0
        with open(raw) as f:
            for line in f:
                stack, _, n = line.rstrip().rpartition(" ")
                frames = stack.split(";")
                if not any(fr.startswith("EngineCore.step (") for fr in frames):
                    continue
                if any(fr.startswith("prefill_until_decoding (") for fr in frames):
                    continue  # decode workload: its prompt steps are not measured
                n = int(n)
                total += n
                self_lines[frames[-1]] += n
                for fr in set(fr.split(" (")[0] + " (" + fr.split(" (")[1].split(":")[0] + ")" for fr in frames
                              if " (" in fr):
                    incl_funcs[fr] += n
    out = io.StringIO()
    print(f"py-spy, {total} samples inside EngineCore.step; leaf lines by own samples:", file=out)
    for fr, n in self_lines.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {shorten(fr)}", file=out)
    print("functions by inclusive samples:", file=out)
    for fr, n in incl_funcs.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {shorten(fr)}", file=out)
    return out.getvalue()


def shorten(frame: str) -> str:
    for marker in ("site-packages/", "/work/main/"):
        if marker in frame:
            head, _, tail = frame.partition("(")
            return head + "(" + tail.split(marker, 1)[1]
    return frame


def workloads(model, num_prompts: int = 8):
    vocab = model.config.vocab_size
    return {
        "rl": ("rl", rl_workload(num_prompts, 4, vocab, seed=0)),
        "decode": ("decode", decode_workload(64, vocab, prompt_len=256, new_tokens=128, seed=0)),
        # the long-context decode of issue #26 at G=1: 16 distinct 900-token prompts, 128 new tokens each
        "long": ("decode", decode_workload(16, vocab, prompt_len=900, new_tokens=128, seed=0)),
        # the few-row tail of issue #60: 4 rows, where a step's fixed cost weighs most
        "tail": ("decode", decode_workload(4, vocab, prompt_len=200, new_tokens=128, seed=0)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--model", default="5m", choices=["5m", "100m"])
    p.add_argument("--prompts", type=int, default=8, help="P of the rl workload")
    p.add_argument("--workloads", default="rl,decode")
    p.add_argument("--passes", default="phases,ops,py")
    p.add_argument("--pyspy", action="store_true")
    p.add_argument("--only", help=argparse.SUPPRESS)  # child mode for py-spy: warm up, run one workload
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = make_model(args.model, args.dtype)
    wls = workloads(model, args.prompts)
    # warm-up (first-call costs)
    run_measured(model, rl_workload(2, 2, model.config.vocab_size, (16, 64), (4, 8), seed=123), "rl")
    if args.only:
        kind, wl = wls[args.only]
        run_measured(model, wl, kind)
        return
    report = io.StringIO()

    def emit(s: str) -> None:
        print(s, end="", flush=True)
        report.write(s)

    emit(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.model} Qwen3-arch {args.dtype}\n")
    passes = args.passes.split(",")
    for name in args.workloads.split(","):
        kind, wl = wls[name]
        emit(f"\n=== workload {name}: {wl.num_requests} requests, {wl.useful_tokens} tokens"
             f"{' (decode steps only)' if kind == 'decode' else ''} ===\n")
        if "phases" in passes:
            emit(phases_pass(model, wl, kind))
        if "ops" in passes:
            emit(ops_pass(model, wl, kind))
        if "py" in passes:
            emit(cprofile_pass(model, wl, kind))
        if args.pyspy:
            emit(pyspy_pass(name, args))
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.getvalue())


if __name__ == "__main__":
    main()
