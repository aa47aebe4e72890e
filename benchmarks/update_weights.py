"""How long `RolloutEngine.update_weights` takes, against a plain torch copy of the same bytes.

A ~100M-parameter Qwen3-architecture model (hidden 768, 12 layers, vocab 32000) is the trainer (fp32).
For each case the engine holds its own copy of the model (fp32, or bf16 for the cast case) and is
updated from the trainer's state dict; the baseline copies the same tensors with
`for p, q in zip(engine_params, trainer_params): p.copy_(q)` (cast included). Each figure is the
median of `--runs` runs, the two taken in turns; the ratio is update_weights / plain copy (1.0 = no overhead). A last
line times `update_weights(model)` on an engine built on the trainer's own model (zero-copy: version bump
and prefix-cache flush only).

    python benchmarks/update_weights.py [--runs 5] [--untied] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

from rollout import ContinuousBatchingConfig, RolloutEngine


def make_model(tied: bool, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                         num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=2048,
                         tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(fns, runs: int) -> list[float]:
    """Median seconds of each function, run in turns (a warm-up first) so that load drift on a shared
    machine hits them alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(runs):
        for t, fn in zip(times, fns, strict=True):
            t.append(timed(fn))
    return [statistics.median(t) for t in times]


def engine_for(model: torch.nn.Module) -> RolloutEngine:
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64)
    return RolloutEngine(model, config=config, generation_config=GenerationConfig(eos_token_id=None))


def bench_case(trainer: torch.nn.Module, dtype: torch.dtype, runs: int) -> tuple[float, float]:
    target = copy.deepcopy(trainer).to(dtype)
    with torch.no_grad():  # start from different values than the trainer's
        for p in target.parameters():
            p.mul_(0.5)
    state = trainer.state_dict()
    pairs = list(zip(list(target.parameters()), list(trainer.parameters()), strict=True))

    def plain_copy() -> None:
        with torch.no_grad():
            for p, q in pairs:
                p.copy_(q)

    with engine_for(target) as engine:
        engine.generate([[1, 2, 3]], temps=0.0, max_new_tokens=2)  # a live, used engine
        engine.update_weights(state)
        for p, q in pairs:
            assert torch.equal(p, q.to(dtype)), "update_weights did not copy the weights"
        t_engine, t_plain = interleaved_medians([lambda: engine.update_weights(state), plain_copy], runs)
    return t_engine, t_plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--untied", action="store_true", help="separate LM head (~125M parameters)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (on a CPU shared with other jobs, 1 gives steadier figures)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    trainer = make_model(tied=not args.untied, seed=0)
    n_params = sum(p.numel() for p in trainer.parameters())
    print(f"Qwen3 {n_params / 1e6:.1f}M parameters ({'untied' if args.untied else 'tied'} head), "
          f"{torch.get_num_threads()} threads, median of {args.runs} runs")
    print(f"{'case':<16}{'update_weights':>16}{'plain copy_':>14}{'ratio':>8}{'GB/s (engine)':>15}")
    for name, dtype in (("fp32 -> fp32", torch.float32), ("fp32 -> bf16", torch.bfloat16)):
        t_engine, t_plain = bench_case(trainer, dtype, args.runs)
        gbytes = n_params * 4 / 1e9  # bytes read from the fp32 source
        print(f"{name:<16}{t_engine * 1e3:>13.1f} ms{t_plain * 1e3:>11.1f} ms{t_engine / t_plain:>8.2f}"
              f"{gbytes / t_engine:>15.2f}")

    with engine_for(trainer) as engine:
        (t_zero,) = interleaved_medians([lambda: engine.update_weights(trainer)], args.runs)
    print(f"{'zero-copy':<16}{t_zero * 1e3:>13.2f} ms   (update_weights(model) on the trainer's own model)")


if __name__ == "__main__":
    main()
