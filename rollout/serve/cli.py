"""`rollout serve MODEL_PATH [flags]`: load a `save_pretrained` directory and serve it (the entry point:
the only place that reads the environment, `ROLLOUT_API_KEY`).

MODEL_PATH may be a PEFT adapter directory (`adapter_config.json`, e.g. a LoRA recipe's `final/`): its base
(`base_model_name_or_path`, a path as saved, else beside the adapter's directory, else a hub id) is loaded and the
adapter served on it unmerged, as `RolloutEngine(peft_model)` serves a PEFT policy. Without peft, or without the
base, the server refuses in one line that names the other way: the base with `--enable-lora`."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import os
import warnings

from rollout.config import ContinuousBatchingConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# NOTE: engine config fields the server sets itself, or that take no value from a command line.
SKIP_FIELDS = {"return_logprobs", "varlen_compile_config", "decode_compile_config"}
TYPES = {"int": int, "float": float, "str": str}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout serve", description="OpenAI-compatible rollout server with RL control")
    p.add_argument("model_path", help="a save_pretrained directory (model and tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (a non-loopback one needs an API key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="Bearer key for every route but /health, /ping, /version, /metrics (or ROLLOUT_API_KEY)")
    p.add_argument("--metrics-require-api-key", action="store_true",
                   help="put /metrics behind the API key too (open by default, as vllm serve)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the path)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + max_tokens")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N ranks (launch with torchrun --nproc-per-node N); rank 0 serves HTTP")
    p.add_argument("--max-body-bytes", type=int, default=16 * 2**20, help="larger request bodies get a 413")
    p.add_argument("--log-level", default="info")
    p.add_argument("--tool-call-parser", default=None, choices=("hermes",),
                   help="parse chat outputs into tool_calls (vLLM's name; hermes: <tool_call>{json}</tool_call>)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: --tool-call-parser alone enables tool_choice auto")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (vLLM's /v1/load_lora_adapter; --max-loras defaults to 1 with it)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: every non-streamed choice carries routed_experts (vLLM's flag; without it a "
                        "request asks with return_routed_experts)")
    engine = p.add_argument_group("engine (ContinuousBatchingConfig fields)")
    for f in dataclasses.fields(ContinuousBatchingConfig):
        if f.name.startswith("_") or f.name in SKIP_FIELDS or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" ", "")
        if kind == "bool":
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif kind.split("|")[0] in TYPES:
            engine.add_argument(flag, type=TYPES[kind.split("|")[0]], default=None)
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to bind a non-loopback address without an API key."""
    if not is_loopback(host) and not api_key:
        raise SystemExit(f"refusing to bind {host!r} without an API key: pass --api-key or set ROLLOUT_API_KEY "
                         "(or serve on 127.0.0.1)")


def wait_policy_advice(environ, num_threads: int) -> str | None:
    """The startup warning of a multi-threaded server whose OpenMP workers spin between regions (no
    `OMP_WAIT_POLICY`), or None. NOTE: the policy is read when torch loads OpenMP, before this code runs, so it
    can only be advised here; measured in benchmarks/RESULTS.md ("Serving load with guidellm")."""
    if num_threads <= 1 or environ.get("OMP_WAIT_POLICY"):
        return None
    return (f"OMP_WAIT_POLICY is unset and torch runs {num_threads} threads: on a machine where other processes are "
            "busy, spinning OpenMP workers wait on descheduled siblings and inter-token latency at low concurrency "
            "can grow 10-30x; start rollout serve with OMP_NUM_THREADS=1 (or OMP_WAIT_POLICY=PASSIVE) there "
            "(docs/serving.md, 'Latency on a shared machine'), or set OMP_WAIT_POLICY=ACTIVE to keep spinning "
            "on a machine of its own")


def engine_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if getattr(args, "enable_lora", False):
        given.setdefault("max_loras", 1)  # NOTE: vLLM's default with --enable-lora
    return ContinuousBatchingConfig(**given)


ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(model_path: str) -> str | None:
    """The base model of the PEFT adapter directory `model_path`, or None when it is no adapter: its
    `base_model_name_or_path` as saved (relative to the directory the training ran in), else the directory of that
    name beside the adapter's (a recipe's `OUTPUT_DIR/init` for `OUTPUT_DIR/final`), else as given (a hub id)."""
    config = os.path.join(model_path, ADAPTER_CONFIG)
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise SystemExit(f"rollout serve: {model_path} is a PEFT adapter whose {ADAPTER_CONFIG} names no base model; "
                         f"serve its base with --enable-lora and load the adapter with POST /v1/load_lora_adapter")
    beside = os.path.join(os.path.dirname(os.path.abspath(model_path)), os.path.basename(os.path.normpath(base)))
    for candidate in (base, beside):
        if os.path.isdir(candidate):
            return candidate
    if os.path.isabs(base) or base.startswith("."):
        raise SystemExit(f"rollout serve: {model_path} is a PEFT adapter of {base}, which is not here (nor {beside}); "
                         "serve the base with --enable-lora and load the adapter with POST /v1/load_lora_adapter")
    return base  # NOTE: a hub id


def load_adapter(model_path: str, base: str, dtype, tp_size: int):
    """The PeftModel of the adapter `model_path` on its `base` (loaded in `dtype`), in eval mode."""
    if tp_size > 1:
        raise SystemExit(f"rollout serve: {model_path} is a PEFT adapter; --tensor-parallel-size does not take one "
                         f"yet: serve {base} with --enable-lora instead")
    try:
        from peft import PeftModel
    except ImportError:
        raise SystemExit(f"rollout serve: {model_path} is a PEFT adapter of {base} and serving it needs peft (the "
                         f"[lora] extra); or serve {base} with --enable-lora and POST /v1/load_lora_adapter") from None
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    try:
        with warnings.catch_warnings():  # NOTE: peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
            return PeftModel.from_pretrained(base_model, model_path).eval()
    except Exception as e:  # NOTE: e.g. an adapter of other shapes: one line, no traceback
        raise SystemExit(f"rollout serve: {model_path} does not load as a PEFT adapter of {base} ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); serve the base with "
                         "--enable-lora and load the adapter with POST /v1/load_lora_adapter") from None


def load(model_path: str, dtype: str, tp_size: int = 1):
    """(model, tokenizer or None, generation config) of a `save_pretrained` directory (sharded over `tp_size`
    ranks with `DistributedConfig(tp_size=...)` when > 1), or of a PEFT adapter directory (a PeftModel on its base,
    `adapter_base`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.distributed import DistributedConfig

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    base = adapter_base(model_path)
    if base is not None:
        model = load_adapter(model_path, base, torch_dtype, tp_size)
    else:
        kwargs = {"distributed_config": DistributedConfig(tp_size=tp_size)} if tp_size > 1 else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, **kwargs)
        model.eval()
    tokenizer, problems = None, []
    for source in (model_path, base) if base is not None else (model_path,):  # NOTE: an adapter's, else its base's
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            break
        except Exception as e:  # NOTE: a model without a tokenizer still serves token ids
            problems.append(f"{source}: {e}")
    if tokenizer is None:
        logging.getLogger("rollout.serve").warning("no tokenizer (%s): token ids only", "; ".join(problems))
    eos: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        eos.update([src] if isinstance(src, int) else (src or []))
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                          eos_token_id=sorted(eos) or None, pad_token_id=getattr(tokenizer, "pad_token_id", None))
    return model, tokenizer, gc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    api_key = args.api_key or os.environ.get("ROLLOUT_API_KEY") or None
    check_bind(args.host, api_key)
    try:
        import uvicorn

        from rollout.serve.app import build_app
    except ImportError as e:
        raise SystemExit(f"rollout serve needs the [serve] extra (pip install 'rollout[serve]'): {e}") from None
    from rollout.api.engine import RolloutEngine
    from rollout.engine.openmp import release_thread_team
    from rollout.serve.tp import follow, refuse_rank0_only_routes

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
    except ValueError as e:
        raise SystemExit(f"rollout serve: {e}") from None
    model, tokenizer, gc = load(args.model_path, args.dtype, args.tensor_parallel_size)
    import torch

    advice = wait_policy_advice(os.environ, torch.get_num_threads())
    if advice:
        logging.getLogger("rollout.serve").warning(advice)
    engine = RolloutEngine(model, tokenizer=tokenizer, config=config, generation_config=gc)
    release_thread_team()  # NOTE: loading ran torch work here; the engine thread steps from now on
    tp = engine.tensor_parallel
    if tp is not None and not tp.leader:
        follow(engine)  # NOTE: rollout.serve.tp: the other ranks follow rank 0's rounds
        return 0
    try:
        try:
            app = build_app(engine, tokenizer, args.served_model_name or args.model_path, api_key,
                            args.max_model_len, args.max_body_bytes, args.tool_call_parser, model_root=args.model_path,
                            metrics_require_api_key=args.metrics_require_api_key,
                            enable_return_routed_experts=args.enable_return_routed_experts)
        except ValueError as e:  # NOTE: e.g. --enable-return-routed-experts on a dense model
            raise SystemExit(f"rollout serve: {e}") from None
        if tp is not None:
            refuse_rank0_only_routes(app)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    finally:
        engine.close()
    return 0
