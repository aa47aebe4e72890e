"""Weight sync from FSDP2 shards into each rank's rollout engine, against DDP, on 2 CPU ranks (gloo).

Each rank builds the same random Qwen3 model (`--size`, default the ~100M of `benchmarks/common.py`),
trains one AdamW step on a random batch (so gradients and optimizer state exist), builds a rollout engine
and times `--runs` syncs:
  - DDP: the engine runs the trainer's own tensors; a sync is `update_weights(model)` (nothing copied);
  - FSDP2 (`trainers.sharding`: `fully_shard` per decoder layer + root): the engine runs a full copy; a sync
    is `update_weights(full_tensor_stream(model))`, one decoder layer's full tensors gathered at a time;
  - FSDP2, the whole model gathered first (`get_model_state_dict(full_state_dict=True)`), the approach the
    bucketed stream replaces: its peak holds the full model beyond the engine's copy.
Per rank: the bytes of the training state it holds (parameters, gradients, AdamW state, from the tensors),
the engine's copy, the largest bucket, and the resident set size sampled every millisecond during the
syncs (peak above the RSS just before them). Medians over runs; both ranks printed.

    python benchmarks/fsdp_sync.py [--size 100m] [--runs 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import threading
import time

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MB = 2**20
CASES = ("ddp", "fsdp_bucketed", "fsdp_whole")


class RssPeak:
    """The highest resident set size seen by a 1 ms sampler while the block runs, minus the size at entry."""

    def __enter__(self):
        self.proc, self.stop = psutil.Process(), threading.Event()
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra = self.peak - self.base


def nbytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def train_step(model, optimizer, vocab: int) -> None:
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # NOTE: keep the gradients' memory, as between steps


def training_bytes(model, optimizer) -> dict[str, float]:
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    return {"params_mb": nbytes(params) / MB, "grads_mb": nbytes(p.grad for p in params if p.grad is not None) / MB,
            "adam_mb": nbytes(state) / MB}


def measure(sync, runs: int) -> dict[str, float]:
    """Median seconds of `runs` syncs after a warm-up; the RSS growth over all of them, the first included
    (a process per case: memory an earlier case freed cannot hide this one's)."""
    times = []
    dist.barrier()
    with RssPeak() as peak:
        held = sync()  # NOTE: warm-up
        for _ in range(runs):
            dist.barrier()
            start = time.perf_counter()
            sync()
            times.append(time.perf_counter() - start)
    return {"sync_s": statistics.median(times), "rss_growth_mb": peak.extra / MB, "held_mb": held / MB}


def rank_main(rank: int, world: int, port: int, size: str, runs: int, case: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from common import make_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from rollout import ContinuousBatchingConfig, RolloutEngine
    from trainers.sharding import FSDPSettings, SyncStats, full_tensor_stream, param_fraction, shard

    engine_config = ContinuousBatchingConfig(page_size=16, num_blocks=64)
    model = make_model(size, initializer_range=0.02).train()
    vocab = model.config.vocab_size
    if case == "ddp":  # NOTE: the engine on the trainer's own tensors
        wrapped, full = DistributedDataParallel(model), model
    else:  # NOTE: the engine on a full copy taken before sharding
        full = copy.deepcopy(model).eval().requires_grad_(False)
        wrapped = shard(model, model, FSDPSettings(), torch.device("cpu"), world) and model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train_step(wrapped, optimizer, vocab)
    engine = RolloutEngine(full, config=engine_config)
    row = {
        **training_bytes(model, optimizer),
        "engine_copy_mb": 0.0 if full is model else nbytes(full.parameters()) / MB,
        "fraction": param_fraction(model),
    }
    stats = SyncStats()

    def ddp_sync() -> int:
        engine.update_weights(model)
        return 0

    def bucketed_sync() -> int:
        engine.update_weights(full_tensor_stream(model, stats))
        return stats.peak_bucket_bytes

    def whole_sync() -> int:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        engine.update_weights(state)
        return nbytes(state.values())

    sync = {"ddp": ddp_sync, "fsdp_bucketed": bucketed_sync, "fsdp_whole": whole_sync}[case]
    row.update(measure(sync, runs))
    engine.close()
    out[rank] = row
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="100m", choices=["5m", "100m"])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    world = 2
    results = {}
    for case in CASES:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(rank_main, args=(world, free_port(), args.size, args.runs, case, out), nprocs=world, join=True)
            results[case] = dict(out)
    print(f"model {args.size}, {world} CPU ranks (gloo, 1 thread each), medians of {args.runs} syncs after a warm-up; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("held_mb: full tensors alive at once during a sync beyond the engine's copy (the largest bucket, or the "
          "whole state dict); rss_growth_mb: the process's RSS peak over the syncs above the RSS before them")
    cols = ["params_mb", "grads_mb", "adam_mb", "engine_copy_mb", "fraction", "sync_s", "held_mb", "rss_growth_mb"]
    print(f"{'case':<14} {'rank':>4} " + " ".join(f"{c:>14}" for c in cols))
    for case in CASES:
        for rank in range(world):
            row = results[case][rank]
            print(f"{case:<14} {rank:>4} " + " ".join(f"{row[c]:>14.3f}" for c in cols))


if __name__ == "__main__":
    main()
