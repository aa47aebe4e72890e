"""tinker-cookbook's RL loop (`tinker_cookbook.rl.train.main`, the arithmetic environment) against
`rollout tinker-serve`, on a tiny warm-started chat model.

    .venv/bin/python benchmarks/tinker_cookbook_rl.py --out runs/tinker_rl    # warm start + both modes
    .venv/bin/python benchmarks/tinker_cookbook_rl.py --out runs/tinker_rl --modes invariant --batches 10

1. Warm start: a tiny Qwen3 (char-level tokenizer with Qwen's chat specials) is fine-tuned on the cookbook's
   own rendering (`qwen3_instruct` renderer, no few-shot prefix) of "What is x + y?" -> the sum, operands in
   [0, `--max-operand`] (9: a task a 0.2M-parameter model learns in minutes here; the cookbook's: 100),
   until greedy exact match over all the problems reaches `--warm-target` (or `--warm-steps` run out).
2. For each mode (`plain`, `invariant` = `--batch-invariant`): the service on that base (in this process, on
   127.0.0.1), and the cookbook's `rl.train.main` with `TINKER_BASE_URL` pointing at it: LoRA rank 8,
   importance-sampling loss, `--batches` batches of `--groups` problems x `--group-size` samples.
3. Prints, per step, the mean reward and `optim/kl_sample_train_v1/v2` from the cookbook's `metrics.jsonl`,
   and writes `summary.json` and the reward plot (`--plot`).

Needs the tinker extra and tinker-cookbook (docs/tinker.md, "tinker-cookbook").
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import string
import sys
import threading
import time
from pathlib import Path

import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
KEY = "tml-local-demo"


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    backend = Tokenizer(
        models.WordLevel({t: i for i, t in enumerate(SPECIAL + chars)}, unk_token="<|endoftext|>")
    )
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"
    )


def make_model(seed: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def dataset_builder(max_operand: int, **fields):
    """The cookbook's `ArithmeticDatasetBuilder` with operands in [0, max_operand] (the cookbook's: [0, 100]);
    the environment (`ArithmeticEnv`: question, answer check, reward) is the cookbook's own."""
    import chz
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import (
        ArithmeticDataset,
        ArithmeticDatasetBuilder,
        ArithmeticEnv,
    )
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class Dataset(ArithmeticDataset):
        def _make_env_group_builder(self, rng):
            x, y = rng.randint(0, max_operand + 1), rng.randint(0, max_operand + 1)
            return ProblemGroupBuilder(
                env_thunk=functools.partial(ArithmeticEnv, x, y, convo_prefix=None, renderer=self.renderer),
                num_envs=self.group_size,
            )

    @chz.chz
    class Builder(ArithmeticDatasetBuilder):
        async def __call__(self):
            renderer = renderers.get_renderer(
                self.renderer_name, tokenizer=get_tokenizer(self.model_name_for_tokenizer)
            )
            return Dataset(
                batch_size=self.batch_size,
                renderer=renderer,
                n_batches=self.n_batches,
                include_fewshot=False,
                group_size=self.group_size,
            ), None

    return Builder(**fields)


class Prompts:
    """The renderer's generation prompt of "What is x + y?" (rendered once, the question spliced in: the
    tokenizer is one token per character)."""

    def __init__(self, renderer, tokenizer) -> None:
        self.tokenizer = tokenizer
        probe = renderer.build_generation_prompt([{"role": "user", "content": "What is 1 + 2?"}]).to_ints()
        q = tokenizer.encode("What is 1 + 2?", add_special_tokens=False)
        at = next(i for i in range(len(probe)) if probe[i : i + len(q)] == q)
        self.head, self.tail = probe[:at], probe[at + len(q) :]
        check = renderer.build_generation_prompt([{"role": "user", "content": "What is 57 + 8?"}]).to_ints()
        assert self(57, 8) == check, "the rendered prompt does not splice"

    def __call__(self, x: int, y: int) -> list[int]:
        return self.head + self.tokenizer.encode(f"What is {x} + {y}?", add_special_tokens=False) + self.tail


def greedy_accuracy(engine, prompts, tokenizer, probs) -> float:
    batch = engine.generate([prompts(x, y) for x, y in probs], temps=0.0, max_new_tokens=5)
    right = 0
    for row, (x, y) in enumerate(probs):
        ids = batch.completion_ids[row][batch.completion_mask[row].bool()].tolist()
        right += ids == tokenizer.encode(str(x + y), add_special_tokens=False) + [2]
    return right / len(probs)


def warm_start(out: Path, args) -> dict:
    """SFT on the cookbook's rendering until held-out greedy exact match reaches the target."""
    from tinker_cookbook import renderers

    from rollout import ContinuousBatchingConfig, RolloutEngine

    tokenizer = make_tokenizer()
    prompts = Prompts(renderers.get_renderer("qwen3_instruct", tokenizer=tokenizer), tokenizer)
    model = make_model(args.seed)
    engine = RolloutEngine(
        model, tokenizer=tokenizer, config=ContinuousBatchingConfig(page_size=16, num_blocks=512)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.warm_lr, weight_decay=0.0)
    every = [(x, y) for x in range(args.max_operand + 1) for y in range(args.max_operand + 1)]
    rng = random.Random(args.seed)
    t0, acc, step = time.time(), 0.0, 0
    for step in range(1, args.warm_steps + 1):
        rows = []
        for _ in range(args.warm_batch):
            x, y = rng.randint(0, args.max_operand), rng.randint(0, args.max_operand)
            p = prompts(x, y)
            rows.append((p, tokenizer.encode(str(x + y), add_special_tokens=False) + [2]))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            mask[i, : len(p) + len(a)] = 1
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.warm_eval_every == 0:
            model.eval()
            engine.update_weights(model)
            acc = greedy_accuracy(engine, prompts, tokenizer, every)
            print(
                f"warm start step {step}: loss {loss.item():.3f}, greedy exact on all problems {acc:.3f} "
                f"({time.time() - t0:.0f} s)",
                flush=True,
            )
            if acc >= args.warm_target:
                break
    engine.close()
    model.eval()
    base = out / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    return {"warm_steps": step, "warm_greedy_exact": acc, "warm_seconds": round(time.time() - t0, 1)}


def run_mode(out: Path, base: Path, mode: str, args) -> list[dict]:
    import uvicorn

    from rollout.tinker.app import build_app
    from rollout.tinker.cli import build_service, load

    model, tokenizer, gc = load(str(base), "float32")
    service = build_service(
        model,
        tokenizer,
        gc,
        str(base),
        out / f"ckpt_{mode}",
        max_lora_rank=16,
        batch_invariant=mode == "invariant",
        num_blocks=1024,
    )
    sock_port = args.port + (1 if mode == "invariant" else 0)
    server = uvicorn.Server(
        uvicorn.Config(build_app(service, KEY), host="127.0.0.1", port=sock_port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    os.environ["TINKER_BASE_URL"] = f"http://127.0.0.1:{sock_port}"
    os.environ["TINKER_API_KEY"] = KEY
    from tinker_cookbook.rl import train

    log = out / f"log_{mode}"
    cfg = train.Config(
        learning_rate=args.lr,
        model_name=str(base),
        recipe_name="rollout_tinker_serve_demo",
        dataset_builder=dataset_builder(
            args.max_operand,
            batch_size=args.groups,
            model_name_for_tokenizer=str(base),
            renderer_name="qwen3_instruct",
            n_batches=args.batches,
            group_size=args.group_size,
        ),
        renderer_name="qwen3_instruct",
        max_tokens=5,
        log_path=str(log),
        eval_every=0,
        save_every=0,
        lora_rank=8,
    )
    t0 = time.time()
    try:
        asyncio.run(train.main(cfg))
    finally:
        server.should_exit = True
        thread.join(30)
        service.close()
        service.engine.close()
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(f"{mode}: {len(rows)} steps in {time.time() - t0:.0f} s", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/tinker_rl"))
    p.add_argument("--modes", default="plain,invariant")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=9, help="operands in [0, N] (the cookbook's env: 100)")
    p.add_argument("--warm-steps", type=int, default=3000)
    p.add_argument("--warm-batch", type=int, default=32)
    p.add_argument("--warm-lr", type=float, default=2e-3)
    p.add_argument("--warm-target", type=float, default=0.3)
    p.add_argument("--warm-eval-every", type=int, default=25)
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--plot", type=Path, default=None, help="write the reward curves here (png)")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / "base"
    summary: dict = {"argv": sys.argv[1:]}
    if not (base / "config.json").exists():
        summary.update(warm_start(args.out, args))
    for mode in args.modes.split(","):
        rows = [r for r in run_mode(args.out, base, mode, args) if r.get("env/all/reward/total") is not None]
        reward = [r.get("env/all/reward/total") for r in rows]
        kl1 = [r.get("optim/kl_sample_train_v1") for r in rows]
        kl2 = [r.get("optim/kl_sample_train_v2") for r in rows]
        for i, r in enumerate(rows):
            print(
                f"{mode} step {i}: reward {reward[i]:.3f}  correct {r.get('env/all/correct', 0.0):.3f}  "
                f"kl_sample_train_v1 {kl1[i]!r}  v2 {kl2[i]!r}",
                flush=True,
            )
        summary[mode] = {
            "reward": reward,
            "correct": [r.get("env/all/correct") for r in rows],
            "kl_sample_train_v1": kl1,
            "kl_sample_train_v2": kl2,
        }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode in args.modes.split(","):
            r = summary[mode]["reward"]
            (line,) = ax.plot(r, lw=0.8, alpha=0.45)
            smooth = [sum(r[max(0, i - 4) : i + 1]) / len(r[max(0, i - 4) : i + 1]) for i in range(len(r))]
            ax.plot(smooth, lw=2, color=line.get_color(), label=f"tinker-serve, {mode} (5-step mean)")
        ax.set_xlabel(f"tinker-cookbook RL step ({args.groups} problems x {args.group_size} samples)")
        ax.set_ylabel("mean reward")
        ax.set_title("tinker_cookbook.rl.train, arithmetic env, tiny warm-started model")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
