"""`rollout tinker-serve BASE_MODEL_DIR [flags]`: the Tinker REST API on a base model (the entry point: reads
`TINKER_API_KEY` when `--api-key` is not given)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout tinker-serve",
        description="Tinker-compatible training and sampling service (LoRA on one base)",
    )
    p.add_argument("model_path", help="the base model: a save_pretrained directory (model and tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (a non-loopback one needs an API key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="the key clients send (tml-...; or TINKER_API_KEY)")
    p.add_argument(
        "--checkpoint-dir",
        default="tinker_checkpoints",
        help="where save_weights / save_state write PEFT directories",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the base_model name clients send (default: the path, which the SDK loads the tokenizer from)",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max-loras", type=int, default=8, help="adapters loaded in the engine at once")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument(
        "--keep-sampler-saves",
        type=int,
        default=2,
        help="save_weights_for_sampler snapshots of one model kept loaded (older ones are unloaded)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="sampler logprobs bitwise equal to the trainer's (one engine per training client)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pages of the engine")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + max_tokens")
    p.add_argument("--log-level", default="info")
    return p


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to bind a non-loopback address without an API key (as `rollout serve`)."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key:
        raise SystemExit(
            f"refusing to bind {host!r} without an API key: pass --api-key tml-... or set "
            "TINKER_API_KEY (or serve on 127.0.0.1)"
        )


def load(model_path: str, dtype: str):
    """(model, tokenizer, generation config) of a `save_pretrained` directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos: set[int] = set()
    for src in (tokenizer.eos_token_id, model.generation_config.eos_token_id):
        eos.update([src] if isinstance(src, int) else (src or []))
    gc = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=16,
        eos_token_id=sorted(eos) or None,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model, tokenizer, gc


def build_service(
    model,
    tokenizer,
    gc,
    base_name: str,
    checkpoint_dir: Path,
    *,
    max_loras: int = 8,
    max_lora_rank: int = 64,
    keep: int = 2,
    batch_invariant: bool = False,
    page_size: int = 16,
    num_blocks: int | None = None,
    max_context: int | None = None,
    poll_s: float = 5.0,
):
    """A `Service` on `model` (the base, in eval mode): its engine, trainer and sampler."""
    from rollout.api.engine import RolloutEngine
    from rollout.config import ContinuousBatchingConfig
    from rollout.tinker.sampling import Sampler
    from rollout.tinker.service import Service
    from rollout.tinker.training import Trainer

    extra = {"num_blocks": num_blocks} if num_blocks else {}
    if batch_invariant:
        config = ContinuousBatchingConfig(page_size=page_size, batch_invariant=True, **extra)

        def make_engine(peft_model):
            return RolloutEngine(peft_model, tokenizer=tokenizer, config=config, generation_config=gc)
    else:
        config = ContinuousBatchingConfig(
            page_size=page_size, max_loras=max_loras, max_lora_rank=max_lora_rank, **extra
        )
        make_engine = None
    engine = RolloutEngine(model, tokenizer=tokenizer, config=config, generation_config=gc)
    trainer = Trainer(model, invariant=batch_invariant, page_size=page_size)
    sampler = Sampler(engine, keep=keep, invariant=batch_invariant, make_engine=make_engine)
    return Service(engine, trainer, sampler, base_name, checkpoint_dir, max_context, poll_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    api_key = args.api_key or os.environ.get("TINKER_API_KEY") or None
    check_bind(args.host, api_key)
    if api_key is not None and not api_key.startswith("tml-"):
        raise SystemExit("rollout tinker-serve: the tinker SDK only sends API keys that start with 'tml-'")
    try:
        import uvicorn

        from rollout.tinker.app import build_app
        from rollout.tinker.wire import pb

        pb()
        import peft  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"rollout tinker-serve needs the [tinker] extra (pip install 'rollout[tinker]'): {e}"
        ) from None
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model, tokenizer, gc = load(args.model_path, args.dtype)
    service = build_service(
        model,
        tokenizer,
        gc,
        args.served_model_name or args.model_path,
        Path(args.checkpoint_dir),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        keep=args.keep_sampler_saves,
        batch_invariant=args.batch_invariant,
        page_size=args.page_size,
        num_blocks=args.num_blocks,
        max_context=args.max_model_len,
    )
    try:
        uvicorn.run(
            build_app(service, api_key), host=args.host, port=args.port, log_level=args.log_level.lower()
        )
    finally:
        service.close()
        service.engine.close()
    return 0
