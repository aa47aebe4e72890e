"""A decode step with and without the fused attention forwards (`rollout/kernels/fused_attention.py`), interleaved.

Two engines on the same model and requests in one process: A as the engine builds it (fused attention and rotary
embedding, q/k/v and gate/up in one small-M call each), B with the attention and rotary modules given their class
forward back and the gated MLPs calling gate and up one by one (as before the change). Their steps alternate, so
the box's drift reaches both; the step times' medians are printed and the generated tokens compared.

    python benchmarks/fused_attention_ab.py --model 100m --rows 16 --group 8 --prompt-len 600 --steps 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import greedy_config, make_model, rl_workload, rollout_version  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.engine.core import EngineCore  # noqa: E402
from rollout.kernels import fused_decoder, fused_layers, linear  # noqa: E402
from rollout.kernels.fused_layers import KERNEL_ATTR  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["5m", "100m"], default="100m")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--group", type=int, default=8, help="rows per prompt (G)")
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--steps", type=int, default=100, help="timed decode steps of each engine")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = make_model(a.model)
    wl = rl_workload(max(a.rows // a.group, 1), a.group, model.config.vocab_size, (a.prompt_len, a.prompt_len),
                     (10**4, 10**4), seed=0)

    def engine():
        core = EngineCore(model, greedy_config(), ContinuousBatchingConfig())
        reqs = [
            core.make_request(ids, request_id=f"r{i}", max_new_tokens=a.steps + 20) for i, ids in enumerate(wl.prompts)
        ]
        for r in reqs:
            core.add(r)
        return core, reqs

    (fused, fused_reqs), (plain, plain_reqs) = engine(), engine()
    dropped = 0
    for m in plain.view.modules():  # NOTE: the fused decoder layers and stack call the fused attention: dropped too
        if KERNEL_ATTR in vars(m) and (type(m).__name__.endswith(("Attention", "RotaryEmbedding"))
                                       or fused_decoder.variant(m)):
            vars(m).pop("forward")
            delattr(m, KERNEL_ATTR)
            dropped += 1
    one_by_one = lambda x, modules: [m(x) for m in modules]  # noqa: E731 - the gated MLP's calls before the change
    print(f"rollout: {rollout_version()}\n{a.model}, {len(wl.prompts)} rows (G={a.group}), prompts {a.prompt_len}, "
          f"{a.threads} threads; B: {dropped} attention / rotary / decoder modules on their class forward", flush=True)
    times = {"fused": [], "class": []}
    for i in range(a.steps + 10):  # NOTE: the first 10 steps (prefill, first decodes) untimed
        for name, core, fn in (("fused", fused, linear.linears), ("class", plain, one_by_one)):
            fused_layers.linears = fn
            t0 = time.perf_counter()
            core.step()
            if i >= 10:
                times[name].append(time.perf_counter() - t0)
    fused_layers.linears = linear.linears
    for name, ts in times.items():
        print(f"  {name:6s} step median {statistics.median(ts) * 1e3:6.2f} ms, min {min(ts) * 1e3:6.2f} ms")
    print(f"  fused / class: {statistics.median(times['class']) / statistics.median(times['fused']):.3f}x")
    same = all(x.to_output().generated_tokens == y.to_output().generated_tokens
               for x, y in zip(fused_reqs, plain_reqs, strict=True))
    print(f"  tokens identical: {same}")


if __name__ == "__main__":
    main()
