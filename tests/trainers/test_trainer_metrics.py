"""The GRPO trainer's rollout metrics recomputed from the batch (issue 33: metrics were checked for
presence or sign only): reward mean / std from the rewards the reward function returned,
`response_length` from the completion mask, `entropy` and the parity probe from a hand forward of the
policy, DAPO's `kept_fraction` from the constant groups, and `kl` against a hand forward of the frozen
initial policy after one update (so it is not trivially 0).
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.training import digit_share

from rollout import ContinuousBatchingConfig
from trainers import GRPOConfig, GRPOTrainer
from trainers.common import completion_forward
from trainers.tasks import AdditionTask, build_tiny_model, make_addition_tokenizer

pytestmark = pytest.mark.timeout(240)

GROUP = 4


def hand_logprobs_and_entropy(module, data) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T) at the completion tokens and the entropy of softmax(logits / T), [N, T]."""
    with torch.no_grad():
        logits = completion_forward(module, data).logits[:, :-1].float()
    logp = (logits / data["temperatures"].float()[:, None, None]).log_softmax(-1)  # [N, T, V]
    chosen = logp.gather(-1, data["completion_ids"][..., None]).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


def test_grpo_rollout_metrics_recomputed_from_the_batch(tmp_path):
    seen: list[float] = []

    def reward(prompts, completions, **kwargs):
        # NOTE: prompts starting with an even digit score a constant 1: DAPO drops their groups
        scores = [
            1.0 if int(p[0]) % 2 == 0 else s for p, s in zip(prompts, digit_share(prompts, completions), strict=True)
        ]
        seen.extend(scores)
        return scores

    tokenizer = make_addition_tokenizer()
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(32)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    initial = copy.deepcopy(model).eval()
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=2, prompts_per_step=4, group_size=GROUP, max_new_tokens=6,
                        temperature=0.8, learning_rate=0.05, algorithm="dapo", beta=0.1, max_resample_rounds=0,
                        log_stdout=False, progress=False, seed=3,
                        engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256))
    trainer = GRPOTrainer(model, tokenizer, reward, dataset, config)
    try:
        trainer.step()  # NOTE: the policy moves away from the reference
        seen.clear()
        data, metrics = trainer.collect()
        mask = data["completion_mask"]
        rewards = torch.tensor(seen, dtype=torch.float64)
        assert len(seen) == mask.shape[0] == 4 * GROUP
        assert metrics["reward_mean"] == pytest.approx(rewards.mean().item(), abs=1e-6)
        assert metrics["reward_std"] == pytest.approx(rewards.std().item(), abs=1e-6)
        assert metrics["response_length"] == pytest.approx(mask.sum(1).double().mean().item())
        constant = rewards.view(-1, GROUP).std(1) == 0  # [groups]
        assert 0 < constant.sum() < len(constant), "the batch should hold kept and dropped groups"
        assert metrics["kept_fraction"] == pytest.approx(1 - constant.double().mean().item())
        assert torch.equal(data["loss_mask"].any(1), (~constant).repeat_interleave(GROUP) & mask.any(1))

        policy = trainer.accelerator.unwrap_model(trainer.model)
        lp, entropy = hand_logprobs_and_entropy(policy, data)
        assert metrics["entropy"] == pytest.approx(entropy[mask].mean().item(), rel=1e-5)
        gap = (data["rollout_logprobs"] - lp)[mask].abs()
        assert metrics["logprob_mismatch_max"] == pytest.approx(gap.max().item(), abs=1e-6)
        assert metrics["logprob_mismatch_mean"] == pytest.approx(gap.mean().item(), abs=1e-6)
        ref, _ = hand_logprobs_and_entropy(initial, data)
        log_ratio = (ref - lp)[mask]
        kl = (torch.exp(log_ratio) - log_ratio - 1).mean().item()
        assert kl > 1e-6  # the update moved the policy
        assert metrics["kl"] == pytest.approx(kl, rel=1e-3, abs=1e-7)
    finally:
        trainer.close()


def test_optimize_averages_metrics_over_optimizer_steps_with_token_shares(tmp_path):
    """2 iterations x 2 minibatches x 2 accumulated micro-batches: each logged number is the mean over the
    4 optimizer steps of the micro-batches' values weighted by their token share of the minibatch
    (DAPO's token mean), and `grad_norm` the mean of the 4 pre-clip norms."""
    tokenizer = make_addition_tokenizer()
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(32)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=1, prompts_per_step=4, group_size=GROUP, max_new_tokens=6,
                        temperature=1.0, learning_rate=0.05, algorithm="dapo", max_resample_rounds=0,
                        num_iterations=2, num_minibatches=2, gradient_accumulation_steps=2,
                        log_stdout=False, progress=False, seed=3,
                        engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256))
    trainer = GRPOTrainer(model, tokenizer, digit_share, dataset, config)
    updates: list[list[tuple[float, dict, float]]] = [[]]
    norms: list[float] = []
    real_loss, real_step = trainer.loss, trainer.clip_and_step

    def loss(micro):
        value, metrics = real_loss(micro)
        updates[-1].append((value.item(), {k: float(v) for k, v in metrics.items()}, float(micro["loss_mask"].sum())))
        return value, metrics

    def clip_and_step():
        norms.append(real_step())
        updates.append([])
        return norms[-1]

    trainer.loss, trainer.clip_and_step = loss, clip_and_step
    try:
        data, _ = trainer.collect()
        assert data["loss_mask"].any(1).sum() >= 4
        logged = trainer.optimize(data)
    finally:
        trainer.close()
    updates.pop()  # NOTE: the empty list opened by the last step
    assert len(updates) == 4 and all(len(u) == 2 for u in updates) and len(norms) == 4
    assert len(set(norms)) == 4 and all(n > 0 for n in norms)

    def averaged(value_of) -> float:
        total = 0.0
        for micros in updates:
            whole = max(sum(tokens for *_, tokens in micros), 1.0)
            total += sum(value_of(v, m) * tokens / whole for v, m, tokens in micros)
        return total / len(updates)

    assert logged["loss"] == pytest.approx(averaged(lambda v, m: v), rel=1e-6, abs=1e-9)
    for key in ("clip_fraction", "ratio_mean", "approx_kl"):
        assert logged[key] == pytest.approx(averaged(lambda v, m, key=key: m[key]), rel=1e-6, abs=1e-9), key
    assert logged["grad_norm"] == pytest.approx(sum(norms) / 4, rel=1e-9)
    shares = [[tokens for *_, tokens in u] for u in updates]
    assert any(a != b for a, b in shares), "every micro-batch held as many tokens: the shares were not tested"


def test_grpo_logs_speculation_of_an_engine_that_speculates(tmp_path):
    """`spec_draft_tokens` / `spec_accepted_tokens` per step add up to the engine's own counters, and
    `spec_acceptance_rate` is their ratio; the same prompts every step (a near-zero learning rate, near-greedy
    sampling) so the prompt's earlier rollouts draft. A plain engine logs none of them."""
    tokenizer = make_addition_tokenizer()
    dataset = AdditionTask(num_digits=2, seed=0).to_dataset(2)
    speculating = ContinuousBatchingConfig(page_size=8, num_blocks=256, max_batch_tokens=256,
                                           speculative_method="ngram", num_speculative_tokens=4)
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=3, prompts_per_step=2, group_size=2, max_new_tokens=12,
                        temperature=0.05, learning_rate=1e-12, log_stdout=False, progress=False,
                        engine_config=speculating)
    with GRPOTrainer(build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0), tokenizer,
                     digit_share, dataset, config) as trainer:
        history = trainer.train()
        totals = trainer.engine.cache_stats()
    assert sum(m["spec_draft_tokens"] for m in history) == totals["spec_draft_tokens"] > 0
    assert sum(m["spec_accepted_tokens"] for m in history) == totals["spec_accepted_tokens"] > 0
    for m in history:
        assert m["spec_acceptance_rate"] == pytest.approx(m["spec_accepted_tokens"] / max(1.0, m["spec_draft_tokens"]))
    plain = GRPOConfig(output_dir=str(tmp_path / "plain"), max_steps=1, prompts_per_step=2, group_size=2,
                       max_new_tokens=4, log_stdout=False, progress=False,
                       engine_config=ContinuousBatchingConfig(page_size=8, num_blocks=256, max_batch_tokens=256))
    with GRPOTrainer(build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0), tokenizer,
                     digit_share, dataset, plain) as trainer:
        assert not any(k.startswith("spec_") for k in trainer.step())


class RepeatAfterTool:
    """Two model turns around a fixed tool message (the same text every episode, so earlier turns draft)."""

    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return [{"role": "tool", "content": "4321"}], 0.0, False
        return None, sum(ch.isdigit() for ch in action) / max(len(action), 1), True


def test_agent_grpo_logs_speculation_of_an_engine_that_speculates(tmp_path):
    """The agent trainer's episodes log `spec_*` like GRPO's rollouts: per-step counts that add up to the engine's
    own counters; a plain engine logs none."""
    from trainers.agent_grpo import AgentGRPOConfig, AgentGRPOTrainer
    from trainers.calculator import make_calculator_tokenizer

    tok = make_calculator_tokenizer()
    dataset = [{"prompt": f"{i:02d}+{i + 3:02d}"} for i in range(2)]
    speculating = ContinuousBatchingConfig(page_size=8, num_blocks=256, max_batch_tokens=256,
                                           speculative_method="ngram", num_speculative_tokens=4)
    settings = dict(max_steps=3, prompts_per_step=2, group_size=2, max_turns=2, max_new_tokens=12, temperature=0.05,
                    learning_rate=1e-12, log_stdout=False, progress=False)
    config = AgentGRPOConfig(output_dir=str(tmp_path), engine_config=speculating, **settings)
    with AgentGRPOTrainer(build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0), tok,
                          RepeatAfterTool, dataset, config) as trainer:
        history = trainer.train()
        totals = trainer.engine.cache_stats()
    assert sum(m["spec_draft_tokens"] for m in history) == totals["spec_draft_tokens"] > 0
    assert sum(m["spec_accepted_tokens"] for m in history) == totals["spec_accepted_tokens"]
    for m in history:
        assert m["spec_acceptance_rate"] == pytest.approx(m["spec_accepted_tokens"] / max(1.0, m["spec_draft_tokens"]))
    plain = AgentGRPOConfig(output_dir=str(tmp_path / "plain"), **{**settings, "max_steps": 1},
                            engine_config=ContinuousBatchingConfig(page_size=8, num_blocks=256, max_batch_tokens=256))
    with AgentGRPOTrainer(build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0), tok,
                          RepeatAfterTool, dataset, plain) as trainer:
        assert not any(k.startswith("spec_") for k in trainer.step())

