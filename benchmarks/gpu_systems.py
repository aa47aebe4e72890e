"""The GPU-speed systems and workloads of benchmarks/device_check.py (issue 40).

- `nano_workload`: nano-vllm's public benchmark (Qwen3-0.6B, 256 sequences, input and output lengths uniform in
  100-1024, ignore EOS; random token ids here, as there), one sample per prompt;
- `OURS`: rollout's configurations on CUDA, by name: `ours_flex` (today's CUDA default), `ours_triton` (the
  Triton paged decode kernel, every step through the general path), `ours_static` (decode steps static over
  persistent buffers, `use_cuda_graph=True`; whether the buckets are captured in CUDA graphs is
  `rollout.model.static_decode`'s business: capture is NOT yet verified on a GPU), `ours_async` (the same with
  `use_async_batching=True`: step k+1 queued before step k's tokens are read, `rollout.engine.async_steps`),
  `ours_async_seeded` (that, every request sampled at temperature 0.6 with its own seed: the counter-based
  generator's one Triton launch a step; tokens are samples, so no greedy comparison).
"""

from __future__ import annotations

import random
import time

from benchmarks.common import RunResult, Workload, run_ours, step_to_end
from rollout import ContinuousBatchingConfig


def nano_workload(vocab: int, num_seqs: int = 256, lengths=(100, 1024), seed: int = 0) -> Workload:
    """nano-vllm's bench.py: `num_seqs` prompts of uniform length in `lengths`, each generating a uniform number of
    tokens in `lengths` (ignore EOS: our runs have no EOS)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(*lengths))] for _ in range(num_seqs)]
    return Workload(prompts, [rng.randint(*lengths) for _ in range(num_seqs)], 1)


def _ours(**fields):
    return lambda model, wl: run_ours(model, wl, ContinuousBatchingConfig(**fields))


def run_seeded(model, wl: Workload, cbc: ContinuousBatchingConfig, temperature: float = 0.6) -> RunResult:
    """`run_ours`'s loop with every request sampled at `temperature`, seeded by its index (the counter stream)."""
    from transformers import GenerationConfig

    from rollout.engine.core import EngineCore

    t0 = time.perf_counter()
    core = EngineCore(model, GenerationConfig(do_sample=True, eos_token_id=None, top_k=0, top_p=1.0), cbc)
    reqs = [core.make_request(ids, request_id=f"req_{i}", max_new_tokens=n, temperature=temperature, seed=1000 + i)
            for i, (ids, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
    steps = step_to_end(core, reqs)
    outs = [r.to_output() for r in reqs]
    return RunResult("ours_async_seeded", time.perf_counter() - t0, [o.generated_tokens for o in outs],
                     extra={"steps": steps, "overlapped": core.pipeline.overlapped if core.pipeline else 0})


ASYNC = dict(attn_backend="triton", use_cuda_graph=True, use_async_batching=True)
OURS = {
    "ours_flex": _ours(attn_backend="flex"),
    "ours_triton": _ours(attn_backend="triton"),
    "ours_static": _ours(attn_backend="triton", use_cuda_graph=True),
    "ours_async": _ours(**ASYNC),
    "ours_async_seeded": lambda model, wl: run_seeded(model, wl, ContinuousBatchingConfig(**ASYNC)),
}
