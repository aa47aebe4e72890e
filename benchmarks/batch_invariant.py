"""What does the batch-invariant mode cost? Engine tokens/s and a trainer step, mode off vs on, fp32 and bf16.

Engine: `RolloutEngine.generate` on the 5M (or 100M) Qwen3-arch model of `benchmarks/common.py`, an RL-like
batch (prompts of 16-128 tokens by default, `--group` samples each, `--new` tokens, temperature 1, seeded), with
`ContinuousBatchingConfig()` vs `ContinuousBatchingConfig(batch_invariant=True)` (same memory settings),
interleaved A/B, median of `--reps`. Useful tokens per second.

Trainer: the teacher-forced work of one GRPO step on that rollout batch: the no-grad old-logprob pass plus
the loss pass with its backward (`scored_logprobs` on `completion_forward`), mode off (the model's own
forward; bf16: under autocast, as `--bf16` trains) vs on (`rollout.invariant.forward.InvariantForward`; bf16:
on bf16 casts of the fp32 weights, as `--bf16 --batch_invariant` trains). Seconds per step, median.

Also prints the parity the mode buys: max |engine - trainer| logprob, off vs on.

    PYTHONPATH=. python benchmarks/batch_invariant.py --threads 2 --reps 3
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault(
    "OMP_WAIT_POLICY", "PASSIVE"
)  # NOTE: as the recipes: spinning threads distort a shared box
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_model  # noqa: E402

from rollout import ContinuousBatchingConfig, RolloutEngine  # noqa: E402
from rollout.invariant.forward import InvariantForward  # noqa: E402
from trainers.common import completion_forward, scored_logprobs  # noqa: E402


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def prompts(n: int, lo: int = 16, hi: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 4000, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def engine_config(invariant: bool) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(
        page_size=16, num_blocks=2048, max_batch_tokens=512, return_logprobs=True, batch_invariant=invariant
    )


def clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: every thread's work, less sensitive to a loaded box)."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    now = clock()
    return now[0] - start[0], now[1] - start[1]


def rollout(engine: RolloutEngine, args, rep: int):
    """One rollout batch; each repetition draws new prompts (the same for both modes), so no repetition is
    served from the prefix cache of the one before."""
    start = clock()
    batch = engine.generate(
        prompts(args.prompts, args.min_prompt, args.max_prompt, seed=rep),
        temps=1.0,
        group_size=args.group,
        max_new_tokens=args.new,
        seed=1,
    )
    return batch, since(start)


def trainer_data(batch) -> dict:
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "completion_ids": batch.completion_ids,
        "temperatures": batch.temperatures,
    }


def trainer_step(forward, data: dict, autocast: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one step's teacher-forced work: the no-grad pass, then the pass with its backward."""
    start = clock()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            scored_logprobs(completion_forward(forward, data).logits, data)
        lp, _ = scored_logprobs(completion_forward(forward, data).logits, data)
    lp.masked_fill(data["completion_ids"] == 0, 0).sum().backward()
    return since(start)


def bench(dtype: str, args) -> dict:
    master = make_model(args.size, "fp32")  # NOTE: the trainer's fp32 weights
    engine_model = master if dtype == "fp32" else copy.deepcopy(master).to(torch.bfloat16)
    engines = {
        mode: RolloutEngine(engine_model, config=engine_config(mode == "on")) for mode in ("off", "on")
    }
    batches, times = {}, {"off": [], "on": []}
    for rep in range(
        args.reps + 1
    ):  # NOTE: the first round warms up (kernel load, allocations) and is dropped
        for mode, engine in engines.items():
            batches[mode], seconds = rollout(engine, args, rep)
            times[mode].append(seconds)
        print(
            f"  {dtype} engine rep: wall off {times['off'][-1][0]:.2f}s on {times['on'][-1][0]:.2f}s, CPU off "
            f"{times['off'][-1][1]:.2f}s on {times['on'][-1][1]:.2f}s ({load()})",
            flush=True,
        )
    for engine in engines.values():
        engine.close()
    tokens = {m: int(b.completion_mask.sum()) for m, b in batches.items()}
    tok_s = {m: tokens[m] / statistics.median(t[0] for t in times[m][1:]) for m in times}
    tok_cpu_s = {m: tokens[m] / statistics.median(t[1] for t in times[m][1:]) for m in times}

    master.train()
    half = None if dtype == "fp32" else torch.bfloat16
    forwards = {"off": master, "on": InvariantForward(master, page_size=16, dtype=half)}
    data = trainer_data(batches["on"])
    parity = {}
    for mode, fwd in forwards.items():
        with (
            torch.no_grad(),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "off" and half is not None),
        ):
            lp, _ = scored_logprobs(completion_forward(fwd, data).logits, data)
        mask = batches["on"].completion_mask.bool()
        parity[mode] = float((lp - batches["on"].logprobs).abs()[mask].max())
    steps = {"off": [], "on": []}
    for _ in range(args.reps + 1):
        for mode, fwd in forwards.items():
            master.zero_grad(set_to_none=True)
            steps[mode].append(trainer_step(fwd, data, autocast=mode == "off" and half is not None))
        print(
            f"  {dtype} trainer rep: wall off {steps['off'][-1][0]:.3f}s on {steps['on'][-1][0]:.3f}s, CPU off "
            f"{steps['off'][-1][1]:.3f}s on {steps['on'][-1][1]:.3f}s ({load()})",
            flush=True,
        )
    step_s = {m: statistics.median(t[0] for t in v[1:]) for m, v in steps.items()}
    step_cpu_s = {m: statistics.median(t[1] for t in v[1:]) for m, v in steps.items()}
    return {
        "tok_s": tok_s,
        "tok_cpu_s": tok_cpu_s,
        "step_s": step_s,
        "step_cpu_s": step_cpu_s,
        "parity": parity,
        "tokens": tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="5m", choices=["5m", "100m"])
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--min_prompt", type=int, default=16)
    p.add_argument("--max_prompt", type=int, default=128)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{args.size}, {args.prompts} prompts of {args.min_prompt}-{args.max_prompt} tokens x G={args.group}, "
        f"{args.new} new tokens, {args.threads} threads, {load()}"
    )
    rows = []
    for dtype in args.dtypes.split(","):
        r = bench(dtype, args)
        rows.append((dtype, r))
    print(
        "\n| dtype | clock | engine tok/s off | on | cost on/off | trainer step s off | on | cost on/off "
        "| parity max off | on |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype, r in rows:
        q = r["parity"]
        for clock_name, t, s in (("wall", r["tok_s"], r["step_s"]), ("CPU", r["tok_cpu_s"], r["step_cpu_s"])):
            print(
                f"| {dtype} | {clock_name} | {t['off']:.0f} | {t['on']:.0f} | {t['off'] / t['on']:.2f}x | "
                f"{s['off']:.3f} | {s['on']:.3f} | {s['on'] / s['off']:.2f}x | {q['off']:.2e} | {q['on']:.1e} |"
            )
    print(load())


if __name__ == "__main__":
    main()
