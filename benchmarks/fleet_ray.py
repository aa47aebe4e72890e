"""Rollout fleets on Ray (issue 47): two 1-CPU engine actors against one 2-thread engine in process, on an RL
generation call, and the seconds of one weight update of the ~100M model to 2 engine actors.

Questions:
1. RL workload (`--prompts` prompts x `--group_size` samples, `--new_tokens` tokens each, T = 1, seeded, the 5M
   Qwen3 of benchmarks/common.py, EOS off): wall seconds of `RolloutFleet(num_engines=2, {"CPU": 1})
   .generate` against `RolloutEngine.generate` at `torch.set_num_threads(2)`, in turns (a warm-up each first,
   then `--runs` rounds, median).
2. `RolloutFleet.update_weights(model)` of the ~100M-parameter model (fp32, tied, ~400 MB; benchmarks/common.py
   "100m") to 2 engines, per `--transfers` (one fleet each, one after the other): "object_store" (one `ray.put` of
   the state dict, each engine reads it from the object store and copies it in) and "collective" (one gloo
   broadcast from the learner, rank 0, to both engine actors in buckets of `--bucket_mb`, each copied in as it
   arrives); median of `--runs` after a warm-up; every update checked: both engines report the new version, the
   collective one went by broadcast.

One local Ray cluster (2 CPUs, 127.0.0.1) for both fleets; each fleet is closed before the next starts.

    python benchmarks/fleet_ray.py [--runs 3]      # -> benchmarks/logs/fleet_ray/results.json
    python benchmarks/fleet_ray.py --skip_generation --transfers collective,object_store
"""

# ruff: noqa: E402
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: as recipes/grpo.py and async_rl.py (a shared 2-core box)

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import make_model  # (benchmarks/ sibling)

from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.fleet import RolloutFleet

LOGS = Path(__file__).resolve().parent / "logs" / "fleet_ray"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def generation(args, tmp: str) -> dict:
    model = make_model("5m", seed=0)
    model.generation_config.eos_token_id = None
    model_dir = os.path.join(tmp, "5m")
    model.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 4096, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 128, (args.prompts,), generator=g)]
    cbc = ContinuousBatchingConfig(page_size=32, num_blocks=1024)
    call = dict(temps=1.0, group_size=args.group_size, max_new_tokens=args.new_tokens, seed=0)
    torch.set_num_threads(2)
    engine = RolloutEngine(model, config=cbc)
    fleet = RolloutFleet(model_dir, num_engines=2, engine_config=cbc, resources_per_engine={"CPU": 1})
    tokens = args.prompts * args.group_size * args.new_tokens
    cases = {"in-process engine, 2 threads": lambda: engine.generate(prompts, **call),
             "fleet of 2 engine actors, 1 CPU each": lambda: fleet.generate(prompts, **call)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for fn in cases.values():
            batch = fn()
            assert int(batch.completion_mask.sum()) == tokens  # NOTE: EOS off: every row runs the whole budget
        for _ in range(args.runs):
            for name, fn in cases.items():
                times[name].append(timed(fn))
    finally:
        fleet.close()
        engine.close()
    return {name: {"median_s": statistics.median(t), "runs_s": t, "tokens_per_s": tokens / statistics.median(t)}
            for name, t in times.items()}


def weight_update(args, tmp: str, transfer: str) -> dict:
    torch.set_num_threads(1)
    model = make_model("100m", seed=0)
    size_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    model_dir = os.path.join(tmp, "100m")
    if not os.path.isdir(model_dir):
        model.save_pretrained(model_dir)
    start = time.perf_counter()
    fleet = RolloutFleet(model_dir, num_engines=2, engine_config=ContinuousBatchingConfig(page_size=16, num_blocks=64),
                         resources_per_engine={"CPU": 1}, start_timeout_s=900, weight_transfer=transfer,
                         bucket_bytes=int(args.bucket_mb * 2**20))
    up_s = time.perf_counter() - start
    runs = []
    try:
        fleet.update_weights(model)  # warm-up
        for _ in range(args.runs):
            runs.append(timed(lambda: fleet.update_weights(model)))
            assert fleet.last_update_path == transfer, fleet.last_update_path
            assert fleet.engine_versions() == [fleet.policy_version] * 2
    finally:
        fleet.close()
    return {"state_mb": size_mb, "engines": 2, "transfer": transfer, "bucket_mb": args.bucket_mb,
            "fleet_start_s": up_s, "median_s": statistics.median(runs), "runs_s": runs, "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=96)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--skip_update", action="store_true", help="question 1 only")
    p.add_argument("--skip_generation", action="store_true", help="question 2 only")
    p.add_argument("--transfers", default="collective,object_store", help="question 2's weight_transfer paths")
    p.add_argument("--bucket_mb", type=float, default=128.0, help="the collective path's bucket")
    p.add_argument("--logs", default=str(LOGS))
    args = p.parse_args()
    import ray

    # NOTE: engines at the learner's priority (Ray's default worker niceness is 15), as RolloutFleet's own cluster
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _system_config={"worker_niceness": 0})
    report = {"args": vars(args), "load_before": os.getloadavg()[0]}
    try:
        with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
            if not args.skip_generation:
                report["generation"] = generation(args, tmp)
                print(json.dumps(report["generation"], indent=1))
            if not args.skip_update:
                report["weight_update_100m"] = {}
                for transfer in args.transfers.split(","):
                    report["weight_update_100m"][transfer] = weight_update(args, tmp, transfer)
                    print(json.dumps(report["weight_update_100m"][transfer], indent=1), flush=True)
    finally:
        ray.shutdown()
    report["load_after"] = os.getloadavg()[0]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    name = "results.json" if not args.skip_generation else "update_results.json"
    (logs / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
