"""Asynchronous vs synchronous GRPO on a generation-heavy task (issue 28): wall-clock per step, reward curves.

Question: when generation is ~40-60% of a synchronous step, how much faster is a step when rollout runs on
one core and the learner on the other (`GRPOConfig(async_rollout=True, max_staleness=1)`, 1 torch thread
each) than the synchronous trainer at 2 torch threads, same steps and seeds; and does it learn alike?

Task ("copy the operand"): the addition task's prompts ("123+456="), completions of exactly
`--max_new_tokens` (128) characters (EOS disabled); reward = the share of completion positions holding the
character of the first operand repeated ("123123123..."), in [0, 1] (random policy ~0.07). The policy: the
embedded recipe's Qwen3 shape (hidden 128, 3 layers, char-level vocab of 16), randomly initialised, seed 0.
GRPO, 8 prompts x 8 samples per step, T = 1.0, lr 2e-3, 1 pass in 2 minibatches.

Each configuration runs in its own process (fresh OpenMP state), runs alternate (sync, async, sync, ...):

    python benchmarks/async_rl.py --steps 40 --repeats 2     # -> benchmarks/logs/async_rl/ (results.json, async_rl.png)

`--system disagg`: the same task with the rollout in a separate PROCESS (`rollout serve`, started by the run
through `rollout.fleet.server_procs.ServerProcesses`, pinned to core 0, 1 OpenMP thread) and the learner
(`trainers.disagg.DisaggGRPOTrainer`) pinned to core 1 at 1 thread; modes "async_disagg" (`async_rollout=True`,
`max_staleness` K: the weights reach the server in flight) against "sync" (in-process, 2 threads), and
`--with_sync_disagg` adds the synchronous disaggregated layout for reference. Times are of `train()` only
(the server start and the trainer's construction are left out, in every mode):

    python benchmarks/async_rl.py --system disagg --steps 30 --repeats 2 --logs benchmarks/logs/async_rl/disagg

`--system fleet` (issue 47): the rollout on a one-engine `RolloutFleet` (a Ray actor on 1 CPU, 1 thread; the
learner at 1 thread), mode "async_fleet" (`GRPOTrainer(..., rollout=fleet)`, `async_rollout=True`), against
"sync" (in-process, 2 threads), "async" (in-process threads, through `train()`) and "async_step" (the same
config driven by the user's own loop of `trainer.step()`), all in one run; times of the steps only:

    python benchmarks/async_rl.py --system fleet --steps 10 --layers 4 --max_new_tokens 96 --repeats 1 \
        --logs benchmarks/logs/async_rl/fleet
"""

# ruff: noqa: E402
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: as recipes/grpo.py (a shared 2-core box)

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LOGS = HERE / "logs" / "async_rl"


def copy_reward(prompts, completions, **columns):
    """Share of positions matching the first operand repeated (length of the budget, set by the caller)."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        operand = prompt.split("+")[0]
        target = (operand * (copy_reward.length // len(operand) + 1))[: copy_reward.length]
        out.append(sum(a == b for a, b in zip(completion, target, strict=False)) / copy_reward.length)
    return out


def run_one(mode: str, args, out_dir: Path) -> None:
    """One training run in this process; metrics.jsonl into `out_dir`."""
    import torch

    from rollout import ContinuousBatchingConfig
    from trainers import GRPOConfig, GRPOTrainer
    from trainers.tasks import AdditionTask, build_tiny_model, make_addition_tokenizer

    if args.switch_interval is not None:  # NOTE: the GIL hand-off interval (Python's default 5 ms)
        sys.setswitchinterval(args.switch_interval)
    if mode.endswith("_disagg"):
        return run_disagg(mode, args, out_dir)
    if mode == "async_fleet":
        return run_fleet(args, out_dir)
    torch.set_num_threads(2 if mode == "sync" else 1)  # NOTE: "sync1": the synchronous trainer at 1 thread
    tokenizer = make_addition_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers, max_position_embeddings=256,
                             seed=0)
    # NOTE: no EOS: every completion runs the whole budget (a generation-heavy, fixed-length workload)
    tokenizer.eos_token = None
    model.generation_config.eos_token_id = None
    copy_reward.length = args.max_new_tokens
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(args.steps * args.prompts_per_step)
    async_fields = dict(async_rollout=True, max_staleness=args.max_staleness, rollout_threads=1, learner_threads=1)
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.steps, prompts_per_step=args.prompts_per_step,
        group_size=args.group_size, max_new_tokens=args.max_new_tokens, temperature=1.0,
        learning_rate=args.lr, num_iterations=1, num_minibatches=2, seed=0, log_stdout=False, progress=False,
        engine_config=ContinuousBatchingConfig(page_size=32, num_blocks=512),
        **(async_fields if mode in ("async", "async_step") else {}),
    )
    start = time.perf_counter()
    with GRPOTrainer(model, tokenizer, copy_reward, dataset, config) as trainer:
        train_start = time.perf_counter()
        if mode == "async_step":  # NOTE: a custom training loop: step() must overlap as train() does
            for _ in range(args.steps):
                trainer.step()
        else:
            trainer.train()
    end = time.perf_counter()
    print(json.dumps({"mode": mode, "wall_s": end - start, "train_s": end - train_start}))


def task(args):
    """(tokenizer, model, dataset) of the copy task, EOS disabled; `copy_reward` set to the budget."""
    from trainers.tasks import AdditionTask, build_tiny_model, make_addition_tokenizer

    tokenizer = make_addition_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers, max_position_embeddings=256,
                             seed=0)
    tokenizer.eos_token = None
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    copy_reward.length = args.max_new_tokens
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(args.steps * args.prompts_per_step)
    return tokenizer, model, dataset


def run_disagg(mode: str, args, out_dir: Path) -> None:
    """One run with 1 rollout server process on core 0 and this learner on core 1 (1 thread each)."""
    import torch

    from rollout.fleet.pool import RolloutPool
    from rollout.fleet.server_procs import ServerProcesses
    from trainers import GRPOConfig
    from trainers.disagg import DisaggGRPOTrainer

    cpus = sorted(os.sched_getaffinity(0))
    server_cpus, learner_cpus = (cpus[:1], cpus[1:2]) if len(cpus) >= 2 else (cpus, cpus)
    if args.no_pin:  # NOTE: 1 thread each, but the OS places them (a shared box: no core is reserved for us)
        server_cpus = learner_cpus = None
    else:
        os.sched_setaffinity(0, learner_cpus)
    torch.set_num_threads(1)
    tokenizer, model, dataset = task(args)
    model_dir = out_dir / "model"  # NOTE: removed at the end (the servers' start point, not a result)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    async_fields = dict(async_rollout=True, max_staleness=args.max_staleness, learner_threads=1)
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.steps, prompts_per_step=args.prompts_per_step,
        group_size=args.group_size, max_new_tokens=args.max_new_tokens, temperature=1.0,
        learning_rate=args.lr, num_iterations=1, num_minibatches=2, seed=0, log_stdout=False, progress=False,
        **(async_fields if mode == "async_disagg" else {}),
    )
    serve_args = ["--dtype", "float32", "--log-level", "warning", "--page-size", "32", "--num-blocks", "512"]
    start = time.perf_counter()
    with ServerProcesses(str(model_dir), n=1, cpus=server_cpus, threads=1, serve_args=serve_args,
                         log_dir=str(out_dir / "servers")) as servers:
        spawn_s = time.perf_counter() - start
        pool = RolloutPool(servers.urls, tokenizer=tokenizer)
        with DisaggGRPOTrainer(model, tokenizer, copy_reward, dataset, config, pool=pool) as trainer:
            train_start = time.perf_counter()
            trainer.train()
        end = time.perf_counter()
    shutil.rmtree(model_dir, ignore_errors=True)
    print(json.dumps({"mode": mode, "wall_s": end - start, "train_s": end - train_start, "spawn_s": spawn_s,
                      "server_cpus": server_cpus, "learner_cpus": learner_cpus}))


def run_fleet(args, out_dir: Path) -> None:
    """One async run with the rollout on a one-engine Ray fleet (1 CPU) and this learner at 1 thread."""
    import torch

    from rollout import ContinuousBatchingConfig
    from rollout.fleet import RolloutFleet
    from trainers import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    tokenizer, model, dataset = task(args)
    model_dir = out_dir / "model"  # NOTE: removed at the end (the engine's start point, not a result)
    model.save_pretrained(model_dir)
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.steps, prompts_per_step=args.prompts_per_step,
        group_size=args.group_size, max_new_tokens=args.max_new_tokens, temperature=1.0,
        learning_rate=args.lr, num_iterations=1, num_minibatches=2, seed=0, log_stdout=False, progress=False,
        async_rollout=True, max_staleness=args.max_staleness, learner_threads=1,
    )
    start = time.perf_counter()
    fleet = RolloutFleet(
        str(model_dir),
        num_engines=1,
        engine_config=ContinuousBatchingConfig(page_size=32, num_blocks=512),
        resources_per_engine={"CPU": 1},
        tokenizer=tokenizer,
        num_cpus=2,
    )
    spawn_s = time.perf_counter() - start
    with GRPOTrainer(model, tokenizer, copy_reward, dataset, config, rollout=fleet) as trainer:
        train_start = time.perf_counter()
        trainer.train()
        end = time.perf_counter()
        update_s = fleet.last_update_s
    shutil.rmtree(model_dir, ignore_errors=True)
    print(json.dumps({"mode": "async_fleet", "wall_s": end - start, "train_s": end - train_start, "spawn_s": spawn_s,
                      "last_update_s": update_s}))


def summary(records: list[dict], skip: int) -> dict:
    """Reward at the start and the end, and the mean per-step time fields after `skip` warm-up steps."""
    body = records[skip:]
    out = {
        "reward_first5": statistics.mean(r["reward_mean"] for r in records[:5]),
        "reward_last5": statistics.mean(r["reward_mean"] for r in records[-5:]),
        "time_generate": statistics.mean(r["time_generate"] for r in body),
        "time_train": statistics.mean(r["time_train"] for r in body),
    }
    if "time_generate_exposed" in body[0]:
        out["time_generate_exposed"] = statistics.mean(r["time_generate_exposed"] for r in body)
        out["staleness_mean"] = statistics.mean(r["staleness_mean"] for r in body)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    p.add_argument("--prompts_per_step", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--max_staleness", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--switch_interval", type=float, default=None, help="sys.setswitchinterval in every run")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--run", choices=["sync", "sync1", "async", "async_step", "async_fleet", "async_disagg",
                                     "sync_disagg"], default=None,
                   help="(internal) one run in this process")
    p.add_argument("--system", choices=["thread", "disagg", "fleet"], default="thread",
                   help="async rollout on a thread of the learner (thread), in a rollout server process (disagg) or "
                        "on a one-engine Ray fleet, with the step()-loop case (fleet)")
    p.add_argument("--with_sync_disagg", action="store_true", help="--system disagg: the synchronous layout too")
    p.add_argument("--no_pin", action="store_true", help="--system disagg: no core pinning (1 thread each still)")
    p.add_argument("--out", default=None)
    p.add_argument("--replot", action="store_true", help="redraw the figure from the last results.json")
    p.add_argument("--logs", default=str(LOGS), help="where the runs, results.json and the figure go")
    p.add_argument("--plot_demo", nargs=2, metavar=("SYNC_DIR", "ASYNC_DIR"), default=None,
                   help="reward curves of two recipes/grpo.py output dirs (without / with --async_rollout)")
    args = p.parse_args()
    if args.plot_demo:
        plot_demo(*args.plot_demo)
        return
    logs = Path(args.logs)
    if args.replot:
        report = json.loads((logs / "results.json").read_text())
        plot(report, logs / "async_rl.png", report["speedup_mean"])
        return
    if args.run:
        run_one(args.run, args, Path(args.out))
        return
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    modes = {"thread": ("sync", "async"), "fleet": ("sync", "async_fleet", "async", "async_step"),
             "disagg": ("sync", "async_disagg", "sync_disagg") if args.with_sync_disagg else ("sync", "async_disagg")
             }[args.system]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in modes:
            out = logs / f"{mode}_{rep}"
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--run", mode, "--out", str(out), "--steps", str(args.steps),
                   "--prompts_per_step", str(args.prompts_per_step), "--group_size", str(args.group_size),
                   "--max_new_tokens", str(args.max_new_tokens), "--max_staleness", str(args.max_staleness),
                   "--lr", str(args.lr), "--hidden", str(args.hidden), "--layers", str(args.layers)]
            if args.switch_interval is not None:
                cmd += ["--switch_interval", str(args.switch_interval)]
            if args.no_pin:
                cmd += ["--no_pin"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode:
                raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
            done = json.loads(proc.stdout.strip().splitlines()[-1])
            wall = done["train_s"] if args.system != "thread" else done["wall_s"]
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            row = {"mode": mode, "rep": rep, "wall_s": wall, "s_per_step": wall / args.steps,
                   "load_before": load, "load_after": os.getloadavg()[0], **summary(records, 2)}
            results[mode].append({**row, "rewards": [r["reward_mean"] for r in records]})
            print(json.dumps(row))
    fast = {"thread": "async", "disagg": "async_disagg", "fleet": "async_fleet"}[args.system]
    pairs = [s["wall_s"] / a["wall_s"] for s, a in zip(results["sync"], results[fast], strict=True)]
    report = {"args": vars(args), "speedup_per_pair": pairs, "speedup_mean": statistics.mean(pairs), **results}
    if args.system == "fleet":  # NOTE: the step() loop against train(), same config
        report["step_loop_vs_train"] = [a["wall_s"] / s["wall_s"] for a, s in
                                        zip(results["async"], results["async_step"], strict=True)]
        print(f"async step() loop / train() speed ratio per pair: {report['step_loop_vs_train']}")
    (logs / "results.json").write_text(json.dumps(report, indent=1))
    print(f"async / sync wall-clock speedup per pair: {[round(x, 3) for x in pairs]}")
    plot(results, logs / "async_rl.png", statistics.mean(pairs))


def plot(results: dict[str, list[dict]], path: Path, speedup: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"sync": "tab:blue", "async": "tab:orange", "async_disagg": "tab:red", "sync_disagg": "tab:green",
              "async_fleet": "tab:purple", "async_step": "tab:brown"}
    for mode, color in colors.items():
        for i, run in enumerate(results.get(mode, [])):
            label = f"{mode} run {i + 1} ({run['s_per_step']:.2f} s/step, load {run['load_before']:.0f})"
            style = "-" if i == 0 else "--"  # NOTE: sync runs are deterministic: their curves coincide
            ax.plot(range(1, len(run["rewards"]) + 1), run["rewards"], style, color=color, alpha=0.9 - 0.3 * i,
                    label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward_mean")
    fast = ("async, rollout server + learner" if "async_disagg" in results else
            "async, one-engine Ray fleet + learner" if "async_fleet" in results else "async (1+1 threads)")
    tokens = results.get("args", {}).get("max_new_tokens", 128)
    ax.set_title(f"GRPO, copy task ({tokens}-token completions), 2 cores\n{fast}, staleness 1,\nvs sync "
                 f"(2 threads): {speedup:.2f}x wall-clock per step", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_demo(sync_dir: str, async_dir: str) -> None:
    """The embedded recipe's reward per step, sync vs `--async_rollout`, into LOGS/demo_async_vs_sync.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, folder, color in (("sync", sync_dir, "tab:blue"), ("async, staleness 1", async_dir, "tab:orange")):
        records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(folder) / "summary.json").read_text())
        label = f"{name}: {summary['reward_first5']:.3f} -> {summary['reward_last5']:.3f}"
        ax.plot([r["step"] for r in records], [r["reward_mean"] for r in records], color=color, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward_mean")
    ax.set_title("recipes/grpo.py (embedded addition demo), sync vs --async_rollout", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(LOGS / "demo_async_vs_sync.png", dpi=120)


if __name__ == "__main__":
    main()
