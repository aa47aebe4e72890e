"""How long one weight update of N rollout servers takes from a learner process: the bucketed
`torch.distributed` broadcast (`RolloutPool.update_weights`, gloo on a CPU) at two bucket sizes, against the
`update_weights_from_disk` fallback (save_pretrained + every server loads it).

The ~100M-parameter Qwen3-architecture model of benchmarks/update_weights.py (fp32, tied embeddings, ~400 MB)
is saved once; `--servers` `rollout serve` children are started on it (1 thread each); each case is timed in
turns (`--runs` rounds after a warm-up, median), so load drift hits them alike. Every update is checked: all
servers report the same new version.

    python benchmarks/weight_broadcast.py [--servers 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from update_weights import make_model  # noqa: E402  (benchmarks/ sibling)

from rollout.fleet.pool import RolloutPool  # noqa: E402
from rollout.fleet.server_procs import ServerProcesses  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    model = make_model(tied=True, seed=0)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    tmp = tempfile.mkdtemp(prefix="wb-")
    model.save_pretrained(os.path.join(tmp, "model"))
    serve = ["--num-blocks", "64", "--page-size", "16", "--dtype", "float32", "--log-level", "warning"]
    with ServerProcesses(os.path.join(tmp, "model"), n=args.servers, threads=1, serve_args=serve,
                         log_dir=os.path.join(tmp, "logs"), start_timeout_s=600) as servers, \
            RolloutPool(servers.urls) as pool, \
            RolloutPool(servers.urls, weight_transfer="disk", disk_dir=os.path.join(tmp, "sync")) as disk:

        def broadcast(bucket_mb: int):
            def run() -> None:
                pool.sync.bucket_bytes = bucket_mb * 2**20
                pool.update_weights(model)
            return run

        def from_disk() -> None:
            disk.update_weights(model)

        cases = {"broadcast, 64 MB buckets": broadcast(64), "broadcast, 4 MB buckets": broadcast(4),
                 "update_weights_from_disk": from_disk}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for fn in cases.values():
            fn()  # warm-up (the broadcast forms its group here)
        for _ in range(args.runs):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        versions = {pool._version(u) for u in servers.urls}
        assert len(versions) == 1, versions
    load = os.getloadavg()
    print(f"{size:.0f} MB of fp32 weights to {args.servers} server(s), median of {args.runs}, "
          f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}:")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"  {name:28s} {m:7.2f} s   ({size / m:6.0f} MB/s of weights; runs {', '.join(f'{x:.2f}' for x in t)})")


if __name__ == "__main__":
    main()
