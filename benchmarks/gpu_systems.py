"""The GPU-speed systems and workloads of benchmarks/device_check.py (issue 40).

- `nano_workload`: nano-vllm's public benchmark (Qwen3-0.6B, 256 sequences, input and output lengths uniform in
  100-1024, ignore EOS; random token ids here, as there), one sample per prompt;
- `OURS`: rollout's configurations on CUDA, by name: `ours_flex` (today's CUDA default), `ours_triton` (the
  Triton paged decode kernel, every step through the general path), `ours_static` (decode steps static over
  persistent buffers, `use_cuda_graph=True`; whether the buckets are captured in CUDA graphs is
  `rollout.model.static_decode`'s business: capture is NOT yet verified on a GPU).
"""

from __future__ import annotations

import random

from benchmarks.common import Workload, run_ours
from rollout import ContinuousBatchingConfig


def nano_workload(vocab: int, num_seqs: int = 256, lengths=(100, 1024), seed: int = 0) -> Workload:
    """nano-vllm's bench.py: `num_seqs` prompts of uniform length in `lengths`, each generating a uniform number of
    tokens in `lengths` (ignore EOS: our runs have no EOS)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(*lengths))] for _ in range(num_seqs)]
    return Workload(prompts, [rng.randint(*lengths) for _ in range(num_seqs)], 1)


def _ours(**fields):
    return lambda model, wl: run_ours(model, wl, ContinuousBatchingConfig(**fields))


OURS = {
    "ours_flex": _ours(attn_backend="flex"),
    "ours_triton": _ours(attn_backend="triton"),
    "ours_static": _ours(attn_backend="triton", use_cuda_graph=True),
}
