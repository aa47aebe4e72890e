"""rollout in-process under TRL 1.16's `AsyncGRPOTrainer` (`rollout.integrations.trl_async`): our
`RolloutWorker` and `InPlaceWeightTransfer` in its `rollout_worker=` / `weight_transfer=` slots, a few
training steps on CPU.

TRL's trainer needs two patches on CPU, both here and nowhere else: its `__init__` asks
`get_peak_flops_per_device` (which calls `torch.cuda.get_device_name`) for an MFU figure, so that returns a
constant; and its policy runs `attn_implementation="tree_fa3"`, whose kernel (`packing._flash_attn`:
flash-attn 3 from the hub) has no CPU build, so `_flash_attn` returns `varlen_attention` below: the same
`flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale, causal,
window_size)` contract (causal aligned bottom-right, GQA by repeated key heads) computed with SDPA, one
packed segment at a time. `token_budget` is set (TRL would ask a vLLM server for `max_model_len`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "trl", minversion="1.16", reason="TRL 1.16's AsyncGRPOTrainer (pip install 'trl==1.16.*')"
)
pytest.importorskip("trl.experimental.async_grpo", reason="TRL without experimental.async_grpo")
pytestmark = pytest.mark.timeout(600)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from support.serving import save_tiny  # noqa: E402
from support.tiny_models import hf_greedy, make_model  # noqa: E402


def varlen_attention(
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1), **_
):
    """flash-attn's `flash_attn_varlen_func` on CPU: q [Tq, H, D], k / v [Tk, Hk, D]; segment i attends its
    keys `cu_k[i]:cu_k[i+1]` with the causal diagonal at the bottom right (flash-attn's alignment)."""
    assert window_size == (-1, -1), "sliding windows are not needed by the tiny model"
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
        vi = v[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
        lq, lk = qe - qs, ke - ks
        mask = None
        if causal:
            mask = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + (lk - lq))
        out[qs:qe] = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=softmax_scale
        ).transpose(0, 1)
    return out


def test_varlen_attention_equals_causal_sdpa_on_one_segment_and_isolates_segments():
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    cu = torch.tensor([0, 7])
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert torch.allclose(varlen_attention(q, k, v, cu, cu, 7, 7), want, atol=1e-6)
    two = varlen_attention(q, k, v, torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7]), 4, 4)
    assert torch.allclose(
        two[3:],
        varlen_attention(q[3:], k[3:], v[3:], torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4),
        atol=1e-6,
    )


def low_ids(completion_ids, **_):
    """The demo task: the share of the completion's tokens with ids under 64 (half the tiny vocabulary), a
    reward every random policy spreads over a group and a tiny model can learn."""
    return [sum(t < 64 for t in ids) / max(1, len(ids)) for ids in completion_ids]


@pytest.fixture
def cpu_trl(monkeypatch):
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: 1e12)
    monkeypatch.setattr(
        packing, "_flash_attn", lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    )
    return async_grpo_trainer


def test_async_grpo_trainer_trains_with_our_worker_and_in_place_weight_transfer(tmp_path, cpu_trl):
    from datasets import Dataset
    from support.serving import make_tokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from rollout.integrations.trl_async import InPlaceWeightTransfer, RolloutWorker

    model_dir = save_tiny(tmp_path / "model")
    tok = make_tokenizer()
    tok.padding_side = "left"
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say a {i}"}] for i in range(8)]})
    worker = RolloutWorker(
        model_name=str(model_dir),
        dataset=ds,
        reward_funcs=[low_ids],
        processing_class=tok,
        num_generations=4,
        max_tokens=8,
        temperature=1.0,
        queue_maxsize=16,
    )
    transfer = InPlaceWeightTransfer(worker)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        num_generations=4,
        max_completion_length=8,
        dtype="float32",
        report_to=[],
        logging_steps=1,
        learning_rate=1e-3,
        weight_sync_steps=1,
        per_device_train_batch_size=8,
        save_strategy="no",
        use_cpu=True,
        seed=0,
        token_budget=256,
    )  # NOTE: else TRL asks a vLLM server for max_model_len
    trainer = cpu_trl.AsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[low_ids],
        args=args,
        train_dataset=ds,
        processing_class=tok,
        rollout_worker=worker,
        weight_transfer=transfer,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    v0 = worker.engine.policy_version
    seen: list = []
    real_get = worker.rollout_buffer.get

    def spy(*a, **k):  # NOTE: the samples the trainer drained, for their model_version
        item = real_get(*a, **k)
        seen.append(item)
        return item

    worker.rollout_buffer.get = spy
    try:
        trainer.train()
    except BaseException:
        worker.close()
        raise
    assert trainer.state.global_step == 3
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved, "no parameter changed: the trainer did not step"
    assert transfer.sent >= 3 and worker.engine.policy_version >= v0 + 3  # the initial sync + one per step
    fresh = make_model("qwen3", seed=0)  # NOTE: the engine serves exactly the trained weights
    missing = fresh.load_state_dict(
        {n: p.detach() for n, p in trainer.model.named_parameters()}, strict=False
    )
    assert not missing.unexpected_keys, missing
    prompt = [5, 6, 7, 8]
    greedy = worker.engine.generate([prompt], temps=0.0, max_new_tokens=6).completion_ids[0].tolist()
    assert greedy == hf_greedy(fresh, prompt, 6)
    worker.close()
    versions = [s.model_version for s in seen]
    assert versions and max(versions) >= 1, versions  # samples of updated weights reached the trainer
    for s in seen:
        assert len(s.input_ids) == len(s.completion_mask) == len(s.old_log_probs)
        assert (s.old_log_probs[s.completion_mask == 0] == 0).all() and (
            s.old_log_probs[s.completion_mask == 1] < 0
        ).all()
        assert math.isfinite(s.advantage)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and all(math.isfinite(h["loss"]) for h in logged)
