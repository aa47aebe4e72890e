"""GRPO with disaggregated rollout: `rollout serve` child processes generate, this process trains.

One command starts everything: the policy (the embedded warm start of recipes/grpo.py, or `--model`) is
saved, `--rollout_servers N` servers are started on it as child processes (127.0.0.1, free ports, pinned to
`--server_cpus` with `--server_threads` OpenMP threads each), the learner pins itself to `--learner_cpus`,
then GRPO (`trainers.disagg.DisaggGRPOTrainer`): each step the prompt groups go to the servers (least-loaded,
per-request deadlines; a dead or hung server is dropped with a log line and its groups resubmitted to the
others), the learner trains on the token ids and logprobs they return, and the new weights go to every
server in one bucketed `torch.distributed` broadcast (gloo on CPU, NCCL on GPU; `--weight_transfer disk`
falls back to `update_weights_from_disk`). Ctrl-C or SIGTERM stops the learner and its servers (no orphans).

The algorithm is recipes/grpo.py's (same defaults: 32 prompts x 8 samples at T=1.2, per-digit addition
reward, 2 passes x 2 minibatches of AdamW at 5e-4); only where generation runs differs.

Launch (2 CPU cores: both servers on core 0, the learner on core 1):
    python recipes/grpo_disagg.py --rollout_servers 2 --output_dir runs/grpo_disagg
    python recipes/grpo_disagg.py --rollout_servers 1 --server_cpus 0 --learner_cpus 1 --steps 50
    python recipes/grpo_disagg.py --rollout_servers 1 --async_rollout --max_staleness 1   # overlap (see below)
With `--async_rollout --max_staleness K` the servers generate step k+1 (up to k+K) while the learner trains on
step k; each broadcast lands in flight (`in_flight="keep"`: running requests go on under the new weights, their
tokens' `weight_versions` show the switch) and the loss corrects stale tokens (`trainers.async_rollout`).
A hub or local model: `--model PATH --dataset FILE --reward exact_match` (the servers load PATH too).
NOTE: `rollout serve` loads its model on the CPU today, so this recipe runs on CPUs; the broadcast's NCCL
path (`WeightBroadcaster(backend="nccl")`) is written for servers on GPUs but untested here (no GPU).
"""

# ruff: noqa: E402
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: see recipes/grpo.py

import argparse
import logging
import time

import torch
from _common import (
    GRPO_EMBEDDED_ENGINE,
    add_async_args,
    async_run_kwargs,
    fresh_output_dir,
    get_reward,
    load_policy_and_prompts,
    make_accelerator,
    plot_rewards,
    read_metrics,
    reward_span,
    run_record,
    summarize,
    write_json,
)
from _grpo_args import TRAIN_PROMPTS, add_grpo_args, grpo_config_kwargs
from accelerate.utils import set_seed

from rollout.fleet.pool import RolloutPool
from rollout.fleet.server_procs import ServerProcesses, install_signal_handlers
from trainers import GRPOConfig
from trainers.disagg import DisaggGRPOTrainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grpo_args(p, output_dir="runs/grpo_disagg")
    p.add_argument("--rollout_servers", type=int, default=2, help="rollout server processes to start")
    p.add_argument("--server_cpus", default=None, help="CPU ids the servers share, e.g. '0' (default: core 0 of 2+)")
    p.add_argument("--learner_cpus", default=None, help="CPU ids of the learner, e.g. '1' (default: the others)")
    p.add_argument("--server_threads", type=int, default=1, help="OpenMP threads per server")
    p.add_argument("--weight_transfer", default="broadcast", choices=["broadcast", "disk"])
    p.add_argument("--bucket_mb", type=float, default=64.0, help="largest flat buffer of one broadcast (MB)")
    p.add_argument("--request_timeout", type=float, default=300.0, help="deadline of one group's request (s)")
    add_async_args(p)  # NOTE: --async_rollout: the servers generate step k+1 while this process trains on step k
    p.add_argument("--serve_args", default="", help="extra `rollout serve` flags, e.g. '--max-batch-tokens 4096'")
    return p.parse_args(argv)


def cpu_split(args) -> tuple[list[int] | None, list[int] | None]:
    """(server CPUs, learner CPUs): the flags, else core 0 for the servers and the rest for the learner."""
    ids = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    if args.server_cpus or args.learner_cpus:
        return (ids(args.server_cpus) if args.server_cpus else None), (
            ids(args.learner_cpus) if args.learner_cpus else None
        )
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return cpus[:1], cpus[1:]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    install_signal_handlers()  # NOTE: SIGTERM unwinds like Ctrl-C: the servers are stopped either way
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: one line per HTTP call otherwise
    server_cpus, learner_cpus = cpu_split(args)
    if learner_cpus:
        os.sched_setaffinity(0, learner_cpus)
        torch.set_num_threads(len(learner_cpus))
    accelerator = make_accelerator()
    set_seed(args.seed)
    fresh_output_dir(accelerator, args.output_dir, record=run_record("recipes/grpo_disagg.py", args),
                     overwrite=args.overwrite)
    start = time.perf_counter()
    model_path, tokenizer, model, dataset, warm_start_s = load_policy_and_prompts(
        accelerator, args, TRAIN_PROMPTS, sft_seed=args.sft_seed
    )
    serve_args = ["--dtype", "float32", "--log-level", "warning", *args.serve_args.split()]
    if not args.model:  # NOTE: the embedded task's engine settings (recipes/_common.py)
        cfg = GRPO_EMBEDDED_ENGINE
        serve_args += ["--page-size", str(cfg.page_size), "--num-blocks", str(cfg.num_blocks),
                       "--max-batch-tokens", str(cfg.max_batch_tokens)]
    config = GRPOConfig(**grpo_config_kwargs(args), log_stdout=True, progress=False, **async_run_kwargs(args))
    spawn = time.perf_counter()
    with ServerProcesses(model_path, n=args.rollout_servers, cpus=server_cpus, threads=args.server_threads,
                         serve_args=serve_args, log_dir=os.path.join(args.output_dir, "servers")) as servers:
        spawn_s = time.perf_counter() - spawn
        pool = RolloutPool(servers.urls, tokenizer=tokenizer, request_timeout_s=args.request_timeout,
                           weight_transfer=args.weight_transfer, bucket_bytes=int(args.bucket_mb * 2**20),
                           disk_dir=os.path.join(args.output_dir, "sync"))
        trainer = DisaggGRPOTrainer(model, tokenizer, get_reward(args.reward), dataset, config,
                                    accelerator=accelerator, pool=pool)
        with trainer:
            trainer.train()
        alive = len(pool.alive)
    history = read_metrics(args.output_dir)
    wall = time.perf_counter() - start
    summary = summarize(history, wall, warm_start_s=warm_start_s, servers_start_s=spawn_s, model=model_path,
                        algorithm=args.algorithm, rollout_servers=args.rollout_servers, servers_alive_at_end=alive,
                        server_cpus=server_cpus, learner_cpus=learner_cpus, weight_transfer=args.weight_transfer)
    first, last = summary["reward_first5"], summary["reward_last5"]
    plot_rewards(history, os.path.join(args.output_dir, "reward.png"),
                 f"disaggregated {args.algorithm} ({args.rollout_servers} servers): reward {first:.3f} -> {last:.3f}")
    write_json(summary, os.path.join(args.output_dir, "summary.json"))
    trainer.policy.save_pretrained(os.path.join(args.output_dir, "final"))
    tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    print(f"{reward_span(summary)} in {summary['steps']} steps, {wall:.0f}s "
          f"({args.rollout_servers} rollout servers, {alive} alive at the end); outputs in {args.output_dir}")
    return summary


if __name__ == "__main__":
    main()
