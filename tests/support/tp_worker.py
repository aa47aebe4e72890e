"""The rank side of `tests/engine/test_tp.py`: run under `torchrun --nproc-per-node 2` on CPU (gloo).

Every check of one launch on models loaded with `DistributedConfig(tp_size=2)` from the checkpoints in
`--ckpt` (one folder per architecture, saved by the test); each rank writes what it saw to
`--out/rank{r}.json` and the test compares the ranks with each other and with the references the ranks
computed on the unsharded model. Last, the stuck rank: rank 1 builds its engine and then stops answering;
rank 0's `generate_batch` must raise `TensorParallelTimeout` within the timeout (`stuck.json`); rank 0
then exits with 3, so torchrun ends rank 1 at once and the launch fails on purpose.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.distributed import DistributedConfig

from rollout import ContinuousBatchingConfig, RolloutEngine, generate_batch, init_continuous_batching
from rollout.engine.tp import TensorParallelTimeout

ARCHS = ("llama", "qwen3", "mistral", "gemma2")
MAX_NEW = 10


def save_checkpoints(ckpt: Path) -> Path:
    """The tiny checkpoints of every check (run once, in the test process, before the launch)."""
    from transformers import LlamaConfig

    from support.tiny_models import COMMON, make_model

    for arch in ARCHS:
        make_model(arch).save_pretrained(ckpt / arch)
    make_model("qwen3", seed=1).save_pretrained(ckpt / "qwen3_b")
    torch.manual_seed(0)
    kv1 = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, max_position_embeddings=1024, **COMMON)
    AutoModelForCausalLM.from_config(kv1).save_pretrained(ckpt / "llama_kv1")
    from trainers.tasks import build_tiny_model, make_addition_tokenizer

    build_tiny_model(make_addition_tokenizer(), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     seed=0).save_pretrained(ckpt / "addition")
    return ckpt


def grpo_trainer(path: Path, output_dir: Path, model=None):
    """A 3-step GRPO run (SGD, seeded sampling) on the tiny addition model at `path` (or `model`): the same
    prompts and sampling seeds in one process and on the two ranks of a TP=2 policy."""
    from accelerate import Accelerator

    from support.training import digit_share
    from trainers import GRPOConfig, GRPOTrainer
    from trainers.tasks import make_addition_tokenizer

    model = model if model is not None else AutoModelForCausalLM.from_pretrained(path)
    rows = [{"prompt": f"{i:03d}+{i:03d}="} for i in range(8)]
    config = GRPOConfig(output_dir=str(output_dir), max_steps=3, prompts_per_step=2, group_size=4, max_new_tokens=6,
                        max_grad_norm=None, shuffle=False, log_stdout=False, progress=False,
                        engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # NOTE: an Accelerator without cpu=True sees one process on a CPU under torchrun: no DDP wrapper and no
    # prompt split (both TP ranks train on the same batch; the gradients are the shards' own)
    return GRPOTrainer(model, make_addition_tokenizer(), digit_share, rows, config, accelerator=Accelerator(),
                       optimizer=optimizer)


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (the shards of a TP model gathered: collective)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def check_grpo(ckpt: Path, out_dir: Path, rank: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(ckpt / "addition", distributed_config=DistributedConfig(tp_size=2))
    trainer = grpo_trainer(ckpt / "addition", out_dir / f"grpo{rank}", model)
    history = trainer.train()
    state = full_state(model)
    if rank == 0:
        torch.save(state, out_dir / "grpo_tp.pt")
    version = trainer.engine.policy_version
    trainer.close()
    return {"rewards": [m["reward_mean"] for m in history], "mismatch": [m["logprob_mismatch_max"] for m in history],
            "version": version}


def load(path: Path, tp: bool):
    attn = "eager" if "gemma2" in path.name else "sdpa"
    kwargs = {"distributed_config": DistributedConfig(tp_size=2)} if tp else {}
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, **kwargs).eval()


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 128, (24,), generator=g).tolist()
    out = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    return out + [shared + [5, 6], shared + [7]]  # NOTE: a shared 24-token prefix (3 pages of 8)


@torch.no_grad()
def reference(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of the unsharded model's `generate`, and their teacher-forced logprobs."""
    x = torch.tensor([ids])
    out = model.generate(x, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(ids):].tolist()
    logp = torch.log_softmax(model(out).logits[0, len(ids) - 1:-1].float(), -1)
    return tokens, logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def run_manager(model, ids: list[list[int]], config: ContinuousBatchingConfig) -> tuple[list, dict]:
    """The seed API: start, add_requests on every rank (same automatic ids), get_result, stop."""
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    manager = init_continuous_batching(model, generation_config=gc, continuous_batching_config=config)
    manager.start()
    rids = manager.add_requests(inputs=ids)
    outs = {}
    for rid in rids:
        out = manager.get_result(request_id=rid, timeout=60)
        assert out is not None, f"no result for {rid}"
        outs[rid] = out
    stats = manager.cache_stats()
    manager.stop()
    manager.destroy()
    return [[outs[r].generated_tokens, outs[r].logprobs, outs[r].request_id] for r in rids], stats


def wait_live(manager, rid: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while rid not in manager.live_request_ids():
        assert time.monotonic() < deadline, f"{rid} never reached this rank"
        time.sleep(0.005)


def check_cancel(model, rank: int) -> dict:
    """A request only rank 0 submits reaches rank 1; rank 0 cancels a request both submitted."""
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    cbc = ContinuousBatchingConfig(page_size=8, num_blocks=64)
    manager = init_continuous_batching(model, generation_config=gc, continuous_batching_config=cbc)
    manager.start()
    manager.add_request([5, 6, 7, 8], request_id="long", max_new_tokens=300, streaming=rank == 0)
    if rank == 0:
        manager.add_request([9, 10, 11], request_id="only0", max_new_tokens=4)
        for n, chunk in enumerate(manager.request_id_iter("long")):
            if n == 2:
                manager.cancel_request("long")
            if chunk.status.is_final:
                long = chunk
                break
    else:
        wait_live(manager, "only0")
        long = manager.get_result(request_id="long", timeout=60)
    only0 = manager.get_result(request_id="only0", timeout=60)
    free, total = manager.cache_stats()["free_blocks"], manager.cache_stats()["num_blocks"]
    manager.stop()
    manager.destroy()
    return {"long": [long.status.name, long.generated_tokens], "only0": [only0.status.name, only0.generated_tokens],
            "all_free": free == total}


def check_engine(path: Path, model, rank: int) -> dict:
    """RolloutEngine: greedy, update_weights from a full state dict, sleep / wake, unseeded sampling."""
    other = load(path.parent / "qwen3_b", tp=False)
    ids = prompts(1)[:3]
    engine = RolloutEngine(model, config=ContinuousBatchingConfig(page_size=8, num_blocks=64))
    if rank == 1:  # NOTE: rank 0's round brings these requests before rank 1 submits them itself
        time.sleep(0.5)
    first = engine.generate(ids, temps=0.0, max_new_tokens=MAX_NEW).completion_ids.tolist()
    if rank == 1:  # NOTE: rank 0's next round must wait until rank 1's weights are new too
        time.sleep(0.5)
    version = engine.update_weights(other.state_dict())
    after = engine.generate(ids, temps=0.0, max_new_tokens=MAX_NEW).completion_ids.tolist()
    engine.sleep()
    kv_asleep = engine.cache_stats()["kv_bytes"]
    engine.wake()
    again = engine.generate(ids, temps=0.0, max_new_tokens=MAX_NEW).completion_ids.tolist()
    sampled = engine.generate(ids, temps=1.0, group_size=4, max_new_tokens=MAX_NEW)
    # NOTE: back to the first weights, from another sharded model (DTensor to DTensor, shard to shard)
    version = engine.update_weights(load(path, tp=True))
    back = engine.generate(ids, temps=0.0, max_new_tokens=MAX_NEW).completion_ids.tolist()
    engine.close()
    return {"first": first, "after": after, "again": again, "back": back, "version": version, "kv_asleep": kv_asleep,
            "after_ref": [reference(other, p)[0] for p in ids],
            "sampled": sampled.completion_ids.tolist(), "sampled_logprobs": sampled.logprobs.tolist()}


def refusals(ckpt: Path, rank: int) -> dict:
    out = {}
    try:  # NOTE: tp_size 2 does not divide the one KV head of this checkpoint
        generate_batch(load(ckpt / "llama_kv1", tp=True), [[1, 2, 3]], GenerationConfig(max_new_tokens=2))
    except ValueError as e:
        out["kv_heads"] = str(e)
    try:
        AutoModelForCausalLM.from_pretrained(
            ckpt / "qwen3", device_map="cpu", distributed_config=DistributedConfig(tp_size=2)
        )
    except ValueError as e:
        out["device_map"] = str(e)
    try:  # NOTE: the ranks pass different page sizes
        generate_batch(load(ckpt / "qwen3", tp=True), [[1, 2, 3]], GenerationConfig(max_new_tokens=2),
                       ContinuousBatchingConfig(page_size=8 * (rank + 1)))
    except ValueError as e:
        out["config"] = str(e)
    return out


def main_mode(ckpt: Path, out_dir: Path, rank: int) -> None:
    result: dict = {"archs": {}}
    for arch in ARCHS:
        tp_model, ref = load(ckpt / arch, tp=True), load(ckpt / arch, tp=False)
        ids = prompts()
        # NOTE: 8-token pages, 16-token steps (chunked prefill), 12 pages for ~230 tokens (preemption)
        cbc = ContinuousBatchingConfig(page_size=8, num_blocks=12, max_batch_tokens=16, return_logprobs=True,
                                       logprobs_mode="raw")
        got, stats = run_manager(tp_model, ids, cbc)
        result["archs"][arch] = {"got": got, "ref": [reference(ref, p) for p in ids], "stats": stats}
        if arch == "qwen3":  # NOTE: preempted pages parked in CPU offload instead of recomputed
            result["offload"] = run_manager(tp_model, ids, cbc.replace(cpu_offload_space=0.01))
            roomy = cbc.replace(num_blocks=64, max_batch_tokens=64)
            result["kv_bytes"] = [run_manager(tp_model, ids, roomy)[1]["kv_bytes"],
                                  run_manager(ref, ids, roomy)[1]["kv_bytes"]]
            result["cancel"] = check_cancel(tp_model, rank)
            result["engine"] = check_engine(ckpt / arch, tp_model, rank)
            gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.0, top_k=0, eos_token_id=None)
            unseeded = generate_batch(tp_model, ids, gc, ContinuousBatchingConfig(page_size=8, num_blocks=64))
            result["unseeded"] = [o.generated_tokens for o in unseeded.values()]
            result["greedy_batch"] = [o.generated_tokens for o in generate_batch(
                tp_model, ids, GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None),
                ContinuousBatchingConfig(page_size=8, num_blocks=64)).values()]
    result["refusals"] = refusals(ckpt, rank)
    result["grpo"] = check_grpo(ckpt, out_dir, rank)
    result["lagging"] = lagging(load(ckpt / "qwen3", tp=True), rank)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    stuck(ckpt, out_dir, rank, timeout=3.0)


def lagging(model, rank: int) -> str | None:
    """Rank 0 updates its weights, rank 1 never does: rank 0's next generate raises with rank 1's reason."""
    engine = RolloutEngine(model, config=ContinuousBatchingConfig(page_size=8, num_blocks=64, cpu_group_timeout=2.0))
    error = None
    if rank == 0:
        engine.update_weights(model)
        try:
            engine.generate([[1, 2, 3]], temps=0.0, max_new_tokens=2)
        except TensorParallelTimeout as e:
            error = str(e)
    else:
        engine.manager.thread.join(timeout=30)  # NOTE: its engine thread ends on the same error
        error = engine.manager.core.tp.broken
    engine.close()
    return error


def stuck(ckpt: Path, out_dir: Path, rank: int, timeout: float) -> None:
    """Last: rank 1 stops answering; rank 0 must raise within `timeout` (then exits 3, ending the launch)."""
    model = load(ckpt / "qwen3", tp=True)
    cbc = ContinuousBatchingConfig(page_size=8, num_blocks=64, cpu_group_timeout=timeout)
    if rank == 1:  # NOTE: builds its engine (collective), then stops answering
        manager = init_continuous_batching(model, continuous_batching_config=cbc)
        time.sleep(120)
        del manager
        return
    start = time.monotonic()
    try:
        generate_batch(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=4), cbc)
        error = None
    except TensorParallelTimeout as e:
        error = str(e)
    (out_dir / "stuck.json").write_text(json.dumps({"error": error, "elapsed": time.monotonic() - start}))
    sys.stdout.flush()
    os._exit(3)  # NOTE: a failing rank: torchrun ends the stuck one


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        main_mode(args.ckpt, args.out, rank)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(2)


if __name__ == "__main__":
    main()
