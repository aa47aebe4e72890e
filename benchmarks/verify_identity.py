"""Why speculative decoding in bf16 parts from plain decoding, and what reading without the attention cascade costs
(issue 60).

A verifying step's rows (each row's last token and its draft) share their full pages, so the `cpu` backend's
cascade kernel reads those pages once for all of a row's tokens and merges them with each token's own keys by
log-sum-exp; a plain step reads each row in one pass. The two round differently, and bf16 logits tie often, so
greedy rows can part. This runs the same 4-row tails (random prompts, `--init 0.02`) in bf16 through a plain and a
speculative engine twice: as shipped (cascade), and with the backend's kernel swapped for the one-pass paged kernel
(`cpu_kernels.paged_decode_attention`, no cascade) in both engines; it prints where each row's tokens part (None:
identical) and the speculative run's seconds in the attention kernel (cProfile's time in it).

    python benchmarks/verify_identity.py --model 5m --seeds 102,103
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import machine_info, make_model, step_to_end  # noqa: E402
from speculation import engine, part  # noqa: E402

from rollout.kernels import cpu_kernels  # noqa: E402


def one_pass(core) -> None:
    """The backend's attention kernel swapped for the one-pass paged kernel (the cascade's `alias` dropped: these
    tails have no forks)."""
    paged = cpu_kernels.paged_decode_attention()

    def kernel(q, k, v, table, row, start, end, ps, scale, cap, out, alias=None):
        paged(q, k, v, table, row, start, end, ps, scale, cap, out)

    core.runner.backend.kernel = kernel


def run(core, prompts: list[list[int]], tokens: int, tag: str) -> list[list[int]]:
    reqs = [core.make_request(p, request_id=f"{tag}_{i}", max_new_tokens=tokens) for i, p in enumerate(prompts)]
    step_to_end(core, reqs)
    return [r.generated for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="5m")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--init", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--seeds", default="102,103")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model, dtype=args.dtype, initializer_range=args.init)
    print(machine_info())
    print(f"model {args.model} {args.dtype} (initializer_range {args.init}), {args.threads} threads, "
          f"{args.rows} rows x {args.tokens} tokens, k={args.k}", flush=True)
    vocab = model.config.vocab_size
    for mode in ("cascade", "one pass"):
        plain, spec = engine(model, 0, 0.0), engine(model, args.k, 0.0)
        if mode == "one pass":
            one_pass(plain)
            one_pass(spec)
        for seed in [int(s) for s in args.seeds.split(",")]:
            rng = random.Random(seed)
            prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.rows)]
            a = run(plain, prompts, args.tokens, f"plain{seed}")
            drafted = spec.cache_stats()["spec_draft_tokens"]
            prof = cProfile.Profile()
            prof.enable()
            b = run(spec, prompts, args.tokens, f"spec{seed}")
            prof.disable()
            attn = sum(v[2] for (_, _, name), v in pstats.Stats(prof).stats.items()
                       if "decode_attention" in name and "built-in" in name)
            parts = [part(u, w) for u, w in zip(a, b, strict=True)]
            drafted = spec.cache_stats()["spec_draft_tokens"] - drafted
            print(f"{mode:8s} seed {seed}: rows part at {parts}; attention in the speculative run "
                  f"{attn * 1e3:.0f} ms ({drafted} tokens drafted)", flush=True)


if __name__ == "__main__":
    main()
