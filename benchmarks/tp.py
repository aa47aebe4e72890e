"""Tensor parallelism on a CPU: the 100M Qwen3-arch model, TP=2 (two ranks, 1 thread each) vs TP=1 (one
process, 2 threads), same cores, same requests, greedy, no EOS.

What it answers: what does sharding cost or buy on one box, and how much memory does each rank hold? On a
CPU both runs use the same two cores, so TP=2 can only lose speed to its all-reduces (two per layer, over
gloo) and to rank 0's per-step messages (`rollout.engine.tp`); its use is the memory per rank (weights and KV
halved), as on GPUs, where it lets a model too big for one device run.

    python benchmarks/tp.py                       # both runs, one after the other; prints a table
    python benchmarks/tp.py --prompts 8 --group 4 --prompt-len 128 --new 64

The model is built here (random weights, `benchmarks/common.make_model("100m")`), saved once, and loaded back
with `from_pretrained` (TP=2: `distributed_config=DistributedConfig(tp_size=2)` under torchrun).
Reported per rank: generated tokens/s (a warm-up `generate` first, then one timed), the parameter bytes it
holds (local shards), its KV cache bytes, and its peak RSS; greedy tokens of the two runs are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from rollout import ContinuousBatchingConfig, RolloutEngine

    torch.set_num_threads(args.threads)
    kwargs = {}
    if args.tp > 1:
        dist.init_process_group("gloo")
        kwargs["distributed_config"] = DistributedConfig(tp_size=args.tp)
    rank = dist.get_rank() if args.tp > 1 else 0
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kwargs).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32768, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    # NOTE: a fixed page count, so the KV bytes compare (sized from free memory, each rank would fill its budget)
    engine = RolloutEngine(model, config=ContinuousBatchingConfig(num_blocks=args.num_blocks))
    engine.generate(prompts[:2], temps=0.0, max_new_tokens=8)  # NOTE: warm-up (kernels, packed weights)
    start = time.perf_counter()
    batch = engine.generate(prompts, temps=0.0, group_size=args.group, max_new_tokens=args.new)
    wall = time.perf_counter() - start
    tokens = int(batch.completion_mask.sum())
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())
    row = {"tp": args.tp, "rank": rank, "threads": args.threads, "tok_s": tokens / wall, "wall_s": wall,
           "tokens": tokens, "param_mib": local / 2**20, "kv_mib": engine.cache_stats()["kv_bytes"] / 2**20,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "completion_ids": batch.completion_ids.tolist()}
    engine.close()
    with open(os.path.join(args.out, f"tp{args.tp}_rank{rank}.json"), "w") as f:
        json.dump(row, f)
    if args.tp > 1:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=48)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir")
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from common import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        make_model("100m").save_pretrained(model_dir)
        common = [
            __file__,
            "--worker",
            "--model-dir",
            model_dir,
            "--out",
            tmp,
            "--prompts",
            str(args.prompts),
            "--group",
            str(args.group),
            "--prompt-len",
            str(args.prompt_len),
            "--new",
            str(args.new),
            "--num-blocks",
            str(args.num_blocks),
        ]
        env = dict(
            os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        )
        load = os.getloadavg()
        subprocess.run([sys.executable, *common, "--tp", "1", "--threads", "2"], env={**env, "OMP_NUM_THREADS": "2"},
                       check=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *common, "--tp", "2",
                        "--threads", "1"], env=env, check=True)
        rows = [
            json.load(open(os.path.join(tmp, name))) for name in ("tp1_rank0.json", "tp2_rank0.json", "tp2_rank1.json")
        ]
    same = rows[0]["completion_ids"] == rows[1]["completion_ids"] == rows[2]["completion_ids"]
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: {os.getloadavg()[0]:.2f}")
    print(f"workload: {args.prompts} prompts x G={args.group}, prompt {args.prompt_len}, {args.new} new tokens, greedy")
    print("| run | rank | threads | tok/s | param MiB | KV MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| TP={r['tp']} | {r['rank']} | {r['threads']} | {r['tok_s']:.1f} | {r['param_mib']:.1f} | "
              f"{r['kv_mib']:.1f} | {r['peak_rss_mib']:.0f} |")
    print(f"greedy tokens identical across TP=1 and both TP=2 ranks: {same}; "
          f"TP=2 / TP=1 speed: {rows[1]['tok_s'] / rows[0]['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
