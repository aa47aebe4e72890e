"""TRL 1.16's `AsyncGRPOTrainer` with rollout in-process (`rollout.integrations.trl_async`) on the demo task
of `tests/integrations/test_trl_async.py` (reward: the share of completion tokens with ids under 64, a tiny
random Qwen3 policy), longer than the test: does the reward rise, and do the samples' `model_version`s follow
the weight syncs? CPU, the test's two CPU patches; one line per step, then first / last 10 steps' mean reward.

    PYTHONPATH=. .venv/bin/python benchmarks/trl_async_demo.py --steps 60 \
        --out benchmarks/logs/trl_async/tiny_qwen3_60steps.txt
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from integrations.test_trl_async import low_ids, varlen_attention
    from support.serving import make_tokenizer, save_tiny
    from trl.experimental.async_grpo import AsyncGRPOConfig, async_grpo_trainer, packing

    from rollout.integrations.trl_async import InPlaceWeightTransfer, RolloutWorker

    torch.set_num_threads(args.threads)
    async_grpo_trainer.get_peak_flops_per_device = lambda *a, **k: 1e12  # NOTE: the test's two CPU patches
    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    tmp = Path(tempfile.mkdtemp())
    model_dir = save_tiny(tmp / "model")
    tok = make_tokenizer()
    tok.padding_side = "left"
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say a {i}"}] for i in range(32)]})
    worker = RolloutWorker(
        model_name=str(model_dir),
        dataset=ds,
        reward_funcs=[low_ids],
        processing_class=tok,
        num_generations=8,
        max_tokens=16,
        temperature=1.0,
        queue_maxsize=64,
    )
    config = AsyncGRPOConfig(
        output_dir=str(tmp / "out"),
        max_steps=args.steps,
        num_generations=8,
        max_completion_length=16,
        dtype="float32",
        report_to=[],
        logging_steps=1,
        learning_rate=args.lr,
        weight_sync_steps=1,
        per_device_train_batch_size=16,
        save_strategy="no",
        use_cpu=True,
        seed=0,
        token_budget=512,
    )
    trainer = async_grpo_trainer.AsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[low_ids],
        args=config,
        train_dataset=ds,
        processing_class=tok,
        rollout_worker=worker,
        weight_transfer=InPlaceWeightTransfer(worker),
    )
    drained: list = []
    get = worker.rollout_buffer.get

    def spy(*a, **k):
        item = get(*a, **k)
        drained.append((item.model_version, item.metrics["reward"]))
        return item

    worker.rollout_buffer.get = spy
    t0 = time.time()
    trainer.train()
    seconds = time.time() - t0
    worker.close()
    lines = [
        f"# benchmarks/trl_async_demo.py --steps {args.steps} --lr {args.lr} --threads {args.threads}",
        f"# torch {torch.__version__}, {seconds:.0f} s of training",
        "step reward loss",
    ]
    steps = [h for h in trainer.state.log_history if "loss" in h]
    rewards = []
    for h in steps:
        r = h.get("reward", h.get("rewards/low_ids/mean", float("nan")))
        rewards.append(r)
        lines.append(f"{h['step']} {r:.4f} {h['loss']:.4f}")
    versions = [v for v, _ in drained]
    lines.append(
        f"samples drained: {len(drained)}; their model_version min {min(versions)} max {max(versions)}; "
        f"non-decreasing: {versions == sorted(versions)}"
    )
    k = min(10, len(rewards) // 2)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    lines.append(f"reward mean, first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
