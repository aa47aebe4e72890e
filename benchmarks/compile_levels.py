"""Does `torch.compile` make our engine faster on this CPU? `default_compile_level` 0-3, measured.

transformers' continuous batching maps `default_compile_level` to a `CompileConfig` for the model
forward (transformers/generation/continuous_batching/initialization.py, `resolve_compile_configs`):
level 1 = mode "default", dynamic=True; level 2 = "max-autotune-no-cudagraphs", dynamic=True;
level 3 = "max-autotune-no-cudagraphs", dynamic=False; fullgraph=False, with the paged attention
excluded from the graph (`torch.compiler.disable`). This script applies exactly that to our engine
view's forward (our paged attention excluded the same way), runs the RL workload of
`throughput.py` on one engine per level (kept alive across runs, as in RL training), checks the greedy outputs against
level 0, and prints the first run (compilation included) and the best of the timed runs, in CPU time, 1 thread.

rollout does not apply these settings (`ContinuousBatchingConfig` accepts them and logs that they
have no effect) because this measurement found no level that wins on CPU; see RESULTS.md.

    python benchmarks/compile_levels.py [--levels 0,1,2,3] [--reps 3] [--model 5m] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import greedy_config, make_model, rl_workload, run_core  # noqa: E402

MODES = {1: ("default", True), 2: ("max-autotune-no-cudagraphs", True), 3: ("max-autotune-no-cudagraphs", False)}


def build(model, level: int):
    from transformers import AttentionInterface

    import rollout.attention.interface as attn
    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    core = EngineCore(model, greedy_config(), ContinuousBatchingConfig())
    if level:
        # NOTE: after EngineCore (whose make_engine_view registers the plain function) so this one stays.
        AttentionInterface.register(attn.ATTN_NAME, torch.compiler.disable(attn.paged_attention_forward))
        mode, dynamic = MODES[level]
        view = core.runner.model
        view.forward = torch.compile(view.forward, mode=mode, dynamic=dynamic, fullgraph=False)
    else:
        AttentionInterface.register(attn.ATTN_NAME, attn.paged_attention_forward)
    return core


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="0,1,2,3")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default="5m", choices=["5m", "100m"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from torch._dynamo.utils import counters

    model = make_model(a.model, a.dtype)
    wl = rl_workload(a.prompts, a.group, model.config.vocab_size, seed=0)
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.model} {a.dtype}, {a.prompts} prompts x G={a.group}, "
          f"{wl.useful_tokens} useful tokens; times are CPU seconds", flush=True)
    ref = None
    rows = []
    for level in (int(x) for x in a.levels.split(",")):
        torch._dynamo.reset()
        counters.clear()
        core = build(model, level)  # NOTE: one engine per level, kept alive across runs as in RL training
        first_cpu, first_wall, out = run_core(core, wl)
        ref = out if ref is None else ref
        graphs_first = counters["stats"].get("unique_graphs", 0)
        best = min(run_core(core, wl)[0] for _ in range(a.reps))
        same = sum(x == y for x, y in zip(out, ref, strict=True))
        graphs = counters["stats"].get("unique_graphs", 0)
        breaks = sum(counters["graph_break"].values())
        late = graphs - graphs_first  # graphs compiled during the timed runs (recompilations)
        rows.append((level, first_cpu, first_wall, best, same, graphs, breaks))
        del core
        print(f"level {level}: first run {first_cpu:7.1f} s CPU ({first_wall:6.1f} s wall), best of {a.reps} "
              f"{best:6.2f} s = {wl.useful_tokens / best:6.0f} tok/s; greedy equal to level 0: {same}/{len(out)}; "
              f"graphs {graphs} ({late} compiled during the timed runs), graph breaks {breaks}", flush=True)
    base = rows[0][3] if rows[0][0] == 0 else None
    if base:
        print("\nlevel | tok/s (best) | vs level 0 | first run incl. compile (CPU s)")
        for level, first_cpu, _, best, *_ in rows:
            print(f"{level:5d} | {wl.useful_tokens / best:12.0f} | {base / best:9.2f}x | {first_cpu:.1f}")


if __name__ == "__main__":
    main()
