"""A few-row decode step with and without the fused decoder layers and stack (`rollout/kernels/fused_decoder.py`).

One engine with `--rows` rows decoding after `--prompt-len`-token prompts (`verify_step.decoding_core`); each round
times one plain decode step's forward and sampler call (`verify_step.timed_step`, which writes K/V past the rows'
computed tokens and changes no request, so the same state is timed again and again) under each variant, the order
rotating round after round:

  class        the decoder layers and stack on their class forwards (their children keep their fused forwards:
               the engine before issue 60's fused decoders)
  layer        the fused decoder layers, the stack's class forward
  layer+stack  both fused, each layer on its Python path (the engine before the native layers)
  native       both fused, each layer of a decode or verifying step one C++ call (`decoder_layer`: the engine now)

Reported per variant: the median wall and CPU time (ms; at 1 thread the CPU time is what a shared box disturbs
least), its ratio to class's, and the load average before and after; then whether the three gave the same logits.

With `--drafts K`, each step is a verifying step of the rows and K random drafted tokens each (`timed_step`).

    python benchmarks/fused_decoder_ab.py --model 5m --rows 4 --threads 1 --rounds 300
    python benchmarks/fused_decoder_ab.py --model 5m --rows 4 --threads 2 --drafts 8
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import make_model  # noqa: E402
from verify_step import decoding_core, load, timed_step  # noqa: E402

from rollout.kernels.fused_decoder import set_native_layers  # noqa: E402
from rollout.kernels.fused_layers import KERNEL_ATTR  # noqa: E402
from rollout.scheduling.stages import ScheduledRequest, SchedulerOutput  # noqa: E402

VARIANTS = {"class": (), "layer": ("decoder layer",), "layer+stack": ("decoder layer", "decoder stack"),
            "native": ("decoder layer", "decoder stack")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="5m")
    ap.add_argument("--init", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drafts", type=int, default=0, help="K: verifying steps of K random drafted tokens a row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model, initializer_range=args.init)
    core = decoding_core(model, args.rows, args.prompt_len, args.drafts, args.seed)
    rng = random.Random(args.seed)
    drafts = [[rng.randrange(1, model.config.vocab_size) for _ in range(args.drafts)]
              for _ in range(args.rows)] if args.drafts else None
    fused = [(m, vars(m)["forward"], vars(m)[KERNEL_ATTR]) for m in core.runner.model.modules()
             if vars(m).get(KERNEL_ATTR) in ("decoder layer", "decoder stack")]
    kinds = [k for _, _, k in fused]
    print(f"model {args.model}, {args.threads} threads, {args.rows} rows, {args.drafts} drafted tokens a row, prompts "
          f"{args.prompt_len}, rounds "
          f"{args.rounds}; fused: {kinds.count('decoder layer')} layers, {kinds.count('decoder stack')} stack; "
          f"load {load()}", flush=True)

    def use(name: str) -> None:
        set_native_layers(core.runner.model, name == "native")
        for m, fwd, kind in fused:
            if kind in VARIANTS[name]:
                m.forward = fwd
            else:
                vars(m).pop("forward", None)

    names = list(VARIANTS)
    logits = {}
    for name in names:  # NOTE: warm-up, and each variant's logits of the same step
        use(name)
        for _ in range(5):
            timed_step(core, drafts)
        rows = core.scheduler.running
        if drafts:
            out = SchedulerOutput([ScheduledRequest(r, 1 + len(d)) for r, d in zip(rows, drafts, strict=True)])
        else:
            out = SchedulerOutput([ScheduledRequest(r, 1) for r in rows], decode_only=True)
        logits[name] = core.runner.execute(out, drafts)[0]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            use(name)
            times[name].append(timed_step(core, drafts))
    use("native")
    base = [statistics.median(t[i] for t in times["class"]) for i in (0, 1)]
    for name in names:
        wall, cpu = (statistics.median(t[i] for t in times[name]) for i in (0, 1))
        print(f"  {name:12s} wall {wall * 1e3:7.3f} ms ({wall / base[0]:.3f}x)  cpu {cpu * 1e3:7.3f} ms "
              f"({cpu / base[1]:.3f}x)")
    same = all(torch.equal(logits[name], logits["class"]) for name in names)
    print(f"  logits identical: {same}; {time.perf_counter() - t0:.0f} s; load {load()}", flush=True)


if __name__ == "__main__":
    main()
