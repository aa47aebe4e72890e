"""Generation inside TRL's `GRPOTrainer`: rollout's `rollout_func` vs TRL's default generation vs
`use_transformers_continuous_batching=True`, same model, batch and steps.

Each backend runs in its own process (this script re-launches itself with `--backend`), through a
real `trl.GRPOTrainer` training run: the benchmark 5M Qwen3-architecture model of benchmarks/common.py
(random weights, fp32, `bf16=False` so that TRL's loss pass is fp32 too), P prompts x G samples per
step, prompts of 16-160 words drawn from a seeded word-level tokenizer over the model's 4096 ids,
`max_completion_length` N at temperature 1.0 (random weights rarely emit EOS, so rows run close to N).
The time of a step's generation is the wall time of `GRPOTrainer._generate` (tokenising, generating,
decoding: everything TRL does between the batch and the rewards), minus the logprob probe's extra
forward when it is on. Step 1 (engine build, kernel load, warm-up) is reported apart from the mean of
the later steps. TRL's transformers-CB path gets a tuned config (small pages, blocks sized to the
step, `max_batch_tokens=512`; transformers' CPU default sizes a multi-GB mask buffer).

The logprob gap is |rollout's logprob - TRL's own recomputation| over every completion token
(`make_rollout_func(logprob_probe=True)`, logged under TRL's `sampling/sampling_logp_difference/*`
names), once with TRL's loss pass in fp32 and once in TRL's default bf16 autocast (`--bf16`).

    python benchmarks/trl_generation.py                        # the table: 3 backends + 2 gap runs
    python benchmarks/trl_generation.py --backend rollout --steps 3 --probe
"""

from __future__ import annotations

import os

# NOTE: before torch loads OpenMP, as the recipes do: with busy-waiting OpenMP threads TRL's padded
# `generate` ran ~30x slower on this shared 2-core box (0.84 s vs 25 s for 8 rows x 16 tokens).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

BACKENDS = ("rollout", "generate", "transformers_cb")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=BACKENDS, default=None, help="run one backend in this process")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (num_generations)")
    p.add_argument("--new_tokens", type=int, default=128, help="max_completion_length")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--probe", action="store_true", help="rollout only: log the logprob gap to TRL's recomputation")
    p.add_argument("--bf16", action="store_true", help="TRL's loss pass in bf16 autocast (its CPU default)")
    p.add_argument("--json", default=None, help="append the result records to this file")
    return p.parse_args(argv)


def word_tokenizer(vocab: int):
    """A word-level fast tokenizer over ids 0..vocab-1: <pad> 0, <bos> 1, <eos> 2, then w3 ... (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    backend = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", padding_side="left")


def length_reward(completions, **_) -> list[float]:
    """Any reward does for timing generation; this one varies inside a group."""
    return [len(c) / 1000.0 for c in completions]


def run_one(args) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import math

    import torch
    import trl
    from common import make_model, num_params
    from datasets import Dataset

    from rollout.integrations.trl import GAP_MAX, GAP_MEAN, make_rollout_func

    model = make_model("5m", "fp32", seed=0)
    vocab = model.config.vocab_size
    tokenizer = word_tokenizer(vocab)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(16, 160)))
               for _ in range(args.prompts * args.steps)]
    rows = args.prompts * args.group
    pages = sum(math.ceil((len(p.split()) + args.new_tokens) / 32) for p in prompts[: args.prompts]) * args.group
    config = trl.GRPOConfig(
        output_dir=os.path.join("/tmp", f"trl_generation_{args.backend}"),
        per_device_train_batch_size=rows,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        max_steps=args.steps,
        learning_rate=1e-5,
        temperature=1.0,
        bf16=args.bf16,
        gradient_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        shuffle_dataset=False,
        seed=0,
        use_transformers_continuous_batching=args.backend == "transformers_cb",
        transformers_continuous_batching_config=dict(page_size=32, num_blocks=pages + 16, max_batch_tokens=512),
    )
    timings: list[dict] = []

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            seconds = time.perf_counter() - start
            probe = self._metrics["train"].get("rollout/probe_s", [0.0])[-1] if args.probe else 0.0
            timings.append({"seconds": seconds - probe, "tokens": sum(len(c) for c in out[1])})
            return out

    rollout_func = make_rollout_func(logprob_probe=args.probe) if args.backend == "rollout" else None
    trainer = TimedGRPOTrainer(model=model, reward_funcs=length_reward, args=config, processing_class=tokenizer,
                               train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollout_func)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    if rollout_func is not None:
        rollout_func.close()
    later = timings[1:] or timings
    gaps = [(h[GAP_MEAN], h[GAP_MAX]) for h in trainer.state.log_history if GAP_MEAN in h]
    return {
        "backend": args.backend,
        "bf16": args.bf16,
        "probe": args.probe,
        "params": num_params(model),
        "prompts": args.prompts,
        "group": args.group,
        "new_tokens": args.new_tokens,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "first_step_generate_s": timings[0]["seconds"],
        "generate_s_per_step": statistics.mean(t["seconds"] for t in later),
        "tokens_per_step": statistics.mean(t["tokens"] for t in later),
        "train_wall_s": wall,
        "per_step": timings,
        "logprob_gap_mean": statistics.mean(g[0] for g in gaps) if gaps else None,
        "logprob_gap_max": max(g[1] for g in gaps) if gaps else None,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.backend is not None:
        record = run_one(args)
        print("RESULT " + json.dumps(record), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")
        return
    common = ["--prompts", str(args.prompts), "--group", str(args.group), "--new_tokens", str(args.new_tokens),
              "--steps", str(args.steps)]
    runs = [[b] for b in BACKENDS] + [["rollout", "--probe"], ["rollout", "--probe", "--bf16"]]
    records = []
    for run in runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--backend", *run, *common]
        if args.json:
            cmd += ["--json", args.json]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{' '.join(run)} failed (exit {out.returncode})")
        records.append(json.loads(lines[-1][len("RESULT "):]))
        r = records[-1]
        print(f"{' '.join(run):28s} generate {r['generate_s_per_step']:.2f} s/step (first "
              f"{r['first_step_generate_s']:.2f}), {r['tokens_per_step']:.0f} tok/step, gap {r['logprob_gap_mean']} / "
              f"{r['logprob_gap_max']}", flush=True)
    base = {r["backend"]: r for r in records[: len(BACKENDS)]}
    print(f"\n{args.prompts} prompts x G={args.group}, max_completion_length {args.new_tokens}, {args.steps} steps "
          f"(step 1 apart), 5M fp32, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}\n")
    print("| backend | generation s / step (steps 2-N) | step 1 | completion tokens / step | tokens / s | vs rollout |")
    print("|---|---|---|---|---|---|")
    for name in BACKENDS:
        r = base[name]
        ratio = r["generate_s_per_step"] / base["rollout"]["generate_s_per_step"]
        print(f"| {name} | {r['generate_s_per_step']:.2f} | {r['first_step_generate_s']:.2f} | "
              f"{r['tokens_per_step']:.0f} | {r['tokens_per_step'] / r['generate_s_per_step']:.0f} | {ratio:.2f}x |")
    print("\n| TRL loss pass | logprob gap mean | max |\n|---|---|---|")
    for r in records[len(BACKENDS):]:
        print(f"| {'bf16 autocast' if r['bf16'] else 'fp32'} | {r['logprob_gap_mean']:.2e} | "
              f"{r['logprob_gap_max']:.2e} |")


if __name__ == "__main__":
    main()
