"""Python overhead of one engine step at many running requests and long contexts, the model forward stubbed.

`--requests` requests with `--context`-token prompts are prefilled, then every step decodes one token for
each of them. The model's forward is replaced by a stub that returns zero logits for the sampled rows
(vocabulary `--vocab`), so what is timed is everything the engine does around the forward: scheduling,
block tables, the step's index tensors and attention metadata (`ModelRunner.prepare`), sampling, and the
bookkeeping after the step. No KV is ever allocated or read.

Reported: the median over `--steps` decode steps of the whole `EngineCore.step()` and of its parts, and a
cProfile of those steps (top functions by own time).

    python benchmarks/step_overhead.py --requests 512 --context 2048 --page-size 16
    python benchmarks/step_overhead.py --attn-backend flex     # the flex backend's metadata (the CUDA default)
    PYTHONPATH=/path/to/other/checkout python benchmarks/step_overhead.py ...   # another version, same script
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from types import SimpleNamespace

if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import rollout  # noqa: E402
from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.engine.core import EngineCore  # noqa: E402


class StubForward(torch.nn.Module):
    """Stands in for the model: zero logits `[1, R, V]` for the rows `logits_to_keep` names."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, logits_to_keep, **kwargs):
        return SimpleNamespace(logits=torch.zeros(1, logits_to_keep.numel(), self.vocab))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens of each request")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attn-backend", default="auto", help="ContinuousBatchingConfig.attn_backend (auto, cpu, sdpa, "
                                                          "flex)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=a.vocab,
        max_position_embeddings=2 * a.context + 64,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    new = 3 * a.steps + 16 + 2 * -(-a.requests * a.context // 8192)  # NOTE: the first prefilled still decode at the end
    pages = 2 * a.requests * (-(-(a.context + new) // a.page_size))  # NOTE: room beyond the safety margin
    core = EngineCore(model, GenerationConfig(do_sample=False, eos_token_id=None),
                      ContinuousBatchingConfig(page_size=a.page_size, num_blocks=pages, max_batch_tokens=8192,
                                               max_requests_per_batch=a.requests, attn_backend=a.attn_backend))
    core.runner.forward = StubForward(a.vocab)  # NOTE: what `ModelRunner.execute` calls
    core.runner.verified = True  # NOTE: the stub runs no attention layer to check
    g = torch.Generator().manual_seed(0)
    for i in range(a.requests):
        ids = torch.randint(0, a.vocab, (a.context,), generator=g).tolist()
        core.add(core.make_request(ids, request_id=f"r{i}", max_new_tokens=new))
    t0 = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
        core.step()
    prefill = time.perf_counter() - t0
    core.step()  # NOTE: the first all-decode step

    parts = {"schedule": [], "prepare": [], "step": [], "step_cpu": []}
    sched, prep = core.scheduler.schedule, core.runner.prepare

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name].append(time.thread_time() - t)
        return wrapper

    core.scheduler.schedule = timed("schedule", sched)
    core.runner.prepare = timed("prepare", prep)
    for _ in range(a.steps):
        t, c = time.perf_counter(), time.thread_time()
        core.step()
        parts["step_cpu"].append(time.thread_time() - c)
        parts["step"].append(time.perf_counter() - t)
    running = len(core.scheduler.running)
    core.scheduler.schedule, core.runner.prepare = sched, prep
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        core.step()
    prof.disable()
    ms = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    print(f"rollout: {os.path.dirname(rollout.__file__)}")
    print(f"{a.requests} requests ({running} running) x {a.context}-token context, page size {a.page_size}, "
          f"vocab {a.vocab}, attn_backend {core.backend.name}, forward stubbed; prefill {prefill:.1f} s; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"median per decode step over {a.steps}, CPU time of the stepping thread: step {ms['step_cpu']:.2f} ms "
          f"(schedule {ms['schedule']:.2f}, prepare {ms['prepare']:.2f}, the rest: stub forward, sampler, bookkeeping "
          f"{ms['step_cpu'] - ms['schedule'] - ms['prepare']:.2f}); wall clock {ms['step']:.2f} ms")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    print(f"cProfile of {a.steps} more decode steps (profiler overhead included):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])


if __name__ == "__main__":
    main()
