"""The trainers' updates against gradients computed by hand (GRPO / Dr. GRPO / DAPO with a KL
penalty, PPO with a clipped value loss and GAE), and their logged metrics recomputed from the batch.

Each test runs one real `collect()` on a tiny addition model, perturbs the batch's old logprobs (so the
ratio clips), reference logprobs (so the KL has a gradient) and old values (so the value loss clips),
takes one SGD step at lr 1 through `optimize()`, and compares the parameter change with minus the
gradient built from closed-form derivatives of the loss with respect to each token's logprob (and
value), chained through the model by autograd. A flipped KL sign, a wrong clip side, a wrong
aggregation weight or a wrong value-clip derivative each change the update.
"""

from __future__ import annotations

import pytest
import torch
from support.training import digit_share, trained_state

from rollout import ContinuousBatchingConfig
from trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trainers.common import completion_forward
from trainers.tasks import AdditionTask, build_tiny_model

pytestmark = pytest.mark.timeout(240)

ENGINE = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256)
TEMPERATURE = 0.8
MAX_NEW = 6
TOP_K = 5


def common_settings(tmp_path, **overrides) -> dict:
    settings = dict(
        output_dir=str(tmp_path), max_steps=1, prompts_per_step=4, group_size=4, max_new_tokens=MAX_NEW,
        temperature=TEMPERATURE, learning_rate=1.0, num_minibatches=1, gradient_accumulation_steps=1,
        num_iterations=1, max_grad_norm=None, log_stdout=False, progress=False, engine_config=ENGINE, seed=3,
    )
    settings.update(overrides)
    return settings


def sgd_step(trainer, data) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(parameter change, metrics) of one `optimize(data)` with SGD at lr 1 (= minus the gradient)."""
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    before = trained_state(trainer)
    metrics = trainer.optimize(data)
    after = trained_state(trainer)
    return {k: after[k] - before[k] for k in before}, metrics


def token_logprobs_by_hand(module, data, top_k: int | None = None) -> torch.Tensor:
    """log softmax(logits / T) (over the top-k logits only, with `top_k`) at the completion tokens, [N, T] with grad."""
    out = completion_forward(module, data)
    logits = out[0] if isinstance(out, tuple) else out.logits
    scaled = logits[:, :-1].float() / data["temperatures"].float()[:, None, None]  # [N, T, V]
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]  # [N, T, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.log_softmax(-1).gather(-1, data["completion_ids"][..., None]).squeeze(-1)


def check_tis_weights(data, cap) -> None:
    """The stored TIS weights are min(exp(trainer old - rollout), cap) on the sampled tokens."""
    mask = data["completion_mask"]
    want = torch.exp(data["old_logprobs"] - data["rollout_logprobs"]).clamp(max=cap)
    assert torch.allclose(data["tis_weights"][mask], want[mask], atol=1e-6)


def perturbed(data, key, scale, seed):
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(data[key].shape, generator=g) * 2 - 1) * scale
    return data[key] + noise.to(data[key].dtype) * data["loss_mask"]


def policy_grad_by_hand(lp, old, adv, mask, clip_low, clip_high):
    """d/d lp of -min(r A, clip(r) A) per token, and the per-token loss and clip indicator."""
    r = torch.exp(lp - old)
    a = adv[:, None] if adv.dim() == 1 else adv
    clipped = ((a > 0) & (r > 1 + clip_high)) | ((a < 0) & (r < 1 - clip_low))  # the flat side of the min
    per_token = torch.where(clipped, -r.clamp(1 - clip_low, 1 + clip_high) * a, -r * a)
    return torch.where(clipped, 0.0, -r * a), per_token, clipped


def aggregation_weights(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """[N, T] weight of each token in the aggregated loss."""
    m = mask.float()
    if agg == "token_mean":
        return m / m.sum()
    if agg == "seq_mean_token_mean":
        lengths = m.sum(1, keepdim=True)
        rows = (lengths > 0).sum()
        return m / lengths.clamp_min(1) / rows
    assert agg == "seq_mean_token_sum_norm"
    return m / (m.shape[0] * MAX_NEW)


def assert_update_is(delta, module, grads_of, tol=2e-5):
    """`delta` (from optimize) is minus the gradient `grads_of` leaves on `module`'s parameters."""
    module.zero_grad(set_to_none=True)
    grads_of()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert grads, "no gradient by hand"
    scale = max(g.abs().max().item() for g in grads.values())
    assert scale > 1e-3
    err = max((delta[n] + g).abs().max().item() for n, g in grads.items())
    assert err < tol * max(1.0, scale), f"update differs from the hand gradient by {err:.3g} (scale {scale:.3g})"
    module.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------ GRPO
@pytest.mark.parametrize(
    "algorithm, agg, clip_low, clip_high",
    [("grpo", "seq_mean_token_mean", 0.2, 0.2), ("dr_grpo", "seq_mean_token_sum_norm", 0.2, 0.2),
     ("dapo", "token_mean", 0.2, 0.28), ("grpo-tis-topk", "seq_mean_token_mean", 0.1, 0.3)],
)
def test_grpo_variants_with_kl_update_equals_the_hand_gradient(
    tokenizer, tmp_path, algorithm, agg, clip_low, clip_high
):
    """The last case overrides both clips, samples with top-k 5 (the trainer scores the truncated
    distribution), weights tokens by TIS and leaves garbage in the padded reference logprobs."""
    beta = 0.5
    extra = {}
    if algorithm == "grpo-tis-topk":
        algorithm, extra = "grpo", dict(clip_low=clip_low, clip_high=clip_high, tis_cap=1.5, top_k=TOP_K)
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(32)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    trainer = GRPOTrainer(model, tokenizer, digit_share, dataset,
                          GRPOConfig(**common_settings(tmp_path, algorithm=algorithm, beta=beta, **extra)))
    try:
        data, metrics = trainer.collect()
        mask = data["loss_mask"]
        assert mask.any()
        if extra:
            check_tis_weights(data, 1.5)
        # the logged kl is the k3 estimate of the batch (policy = reference at step 0: exactly 0)
        assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
        assert (data["ref_logprobs"] - data["old_logprobs"])[mask].abs().max() < 1e-5
        if algorithm == "dr_grpo":
            # NOTE: one more padded column: T = MAX_NEW + 1, and the divisor must stay MAX_NEW
            data = {k: torch.cat([v, torch.zeros_like(v[:, :1])], 1) if v.dim() == 2 else v for k, v in data.items()}
            mask = data["loss_mask"]
            assert mask.shape[1] == MAX_NEW + 1
        data["old_logprobs"] = perturbed(data, "old_logprobs", 0.4, seed=1)
        data["ref_logprobs"] = perturbed(data, "ref_logprobs", 0.4, seed=2)
        top_k, tis = extra.get("top_k"), torch.ones_like(data["old_logprobs"])
        if extra:
            assert (~mask).any()
            data["ref_logprobs"] = torch.where(mask, data["ref_logprobs"], 1000.0)  # exp would overflow
            data["tis_weights"] = tis = 1 + perturbed(data, "tis_weights", 0.5, seed=3) - data["tis_weights"]
        delta, logged = sgd_step(trainer, data)
        policy = trainer.policy
        # undo the step: the hand gradient is at the weights the update started from
        for name, p in policy.named_parameters():
            p.data -= delta[name]

        w = aggregation_weights(mask, agg)
        holder = {}

        def grads_of():
            lp = token_logprobs_by_hand(policy, data, top_k)
            g_pol, per_token, clipped = policy_grad_by_hand(lp.detach(), data["old_logprobs"], data["advantages"], mask,
                                                            clip_low, clip_high)
            log_ratio = torch.where(mask, data["ref_logprobs"] - lp.detach(), 0.0)
            k3 = torch.exp(log_ratio) - log_ratio - 1
            g_kl = 1 - torch.exp(log_ratio)  # d k3 / d lp
            grad = torch.where(mask, w * (tis * g_pol + beta * g_kl), 0.0)
            lp.backward(grad)
            holder.update(policy=(w * tis * per_token)[mask].sum().item(), kl=(w * k3)[mask].sum().item(),
                          clip=clipped[mask].float().mean().item())

        assert_update_is(delta, policy, grads_of)
        assert 0 < holder["clip"] < 1  # the perturbation exercised both sides of the clip
        assert logged["kl_loss"] == pytest.approx(holder["kl"], rel=1e-4)
        assert logged["loss"] == pytest.approx(holder["policy"] + beta * holder["kl"], rel=1e-4, abs=1e-6)
        assert logged["clip_fraction"] == pytest.approx(holder["clip"], abs=1e-6)
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------- PPO
def gae_by_hand(token_rewards, values, mask, gamma, lam):
    n, t = values.shape
    adv = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        running, next_value = 0.0, 0.0
        for j in reversed([j for j in range(t) if mask[i, j]]):
            delta = float(token_rewards[i, j]) + gamma * next_value - float(values[i, j])
            running = delta + gamma * lam * running
            adv[i, j] = running
            next_value = float(values[i, j])
    returns = torch.where(mask, adv + values.double(), 0.0)
    return adv, returns


def test_ppo_gae_and_update_with_clipped_value_loss_equal_the_hand_gradient(tokenizer, tmp_path):
    gamma, lam, vf_coef, value_clip, clip_low, clip_high = 0.9, 0.8, 0.5, 0.3, 0.15, 0.25  # NOTE: no defaults
    seen = []

    def recorded_reward(prompts, completions, **kwargs):
        scores = digit_share(prompts, completions)
        seen.extend(scores)
        return scores

    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(32)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
        settings = common_settings(tmp_path, prompts_per_step=8, group_size=1, gamma=gamma, lam=lam,
                                   vf_coef=vf_coef, value_clip=value_clip, clip_low=clip_low, clip_high=clip_high,
                                   tis_cap=1.5, top_k=TOP_K)
        trainer = PPOTrainer(model, tokenizer, recorded_reward, dataset, PPOConfig(**settings))
    try:
        data, metrics = trainer.collect()
        mask = data["loss_mask"]
        values = data["old_values"]
        # GAE by hand: the score on each row's last token, discounted backwards over its tokens
        token_rewards = torch.zeros_like(values)
        for i, score in enumerate(seen):
            token_rewards[i, int(mask[i].nonzero().max())] = score
        adv, returns = gae_by_hand(token_rewards, values, mask, gamma, lam)
        assert torch.allclose(data["returns"].double(), returns, atol=1e-5)
        mean = adv[mask].mean()
        std = adv[mask].var(unbiased=False).sqrt()
        whitened = torch.where(mask, (adv - mean) / std, 0.0)
        assert torch.allclose(data["advantages"].double(), whitened, atol=1e-4)
        assert metrics["returns_mean"] == pytest.approx(returns[mask].mean().item(), rel=1e-5)
        assert metrics["reward_mean"] == pytest.approx(sum(seen) / len(seen), rel=1e-6)

        check_tis_weights(data, 1.5)
        values0 = data["old_values"].clone()  # NOTE: the values the update's forward sees (same weights)
        data["tis_weights"] = tis = 1 + perturbed(data, "tis_weights", 0.5, seed=3) - data["tis_weights"]
        data["old_logprobs"] = perturbed(data, "old_logprobs", 0.4, seed=1)
        data["old_values"] = perturbed(data, "old_values", 0.5, seed=2)
        delta, logged = sgd_step(trainer, data)
        module = trainer.value_model
        for name, p in module.named_parameters():
            p.data -= delta[name]
        w = aggregation_weights(mask, "token_mean")
        holder = {}

        def grads_of():
            out_logits, out_values = completion_forward(module, data)
            v = out_values[:, :-1]
            scaled = out_logits[:, :-1].float() / data["temperatures"].float()[:, None, None]
            kth = scaled.topk(TOP_K, dim=-1).values[..., -1:]  # [N, T, 1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            lp = scaled.log_softmax(-1).gather(-1, data["completion_ids"][..., None]).squeeze(-1)
            g_pol, per_token, _ = policy_grad_by_hand(lp.detach(), data["old_logprobs"], data["advantages"], mask,
                                                      clip_low, clip_high)
            g_pol, per_token = tis * g_pol, tis * per_token
            old, ret, vd = data["old_values"], data["returns"], v.detach()
            inside = (vd - old).abs() < value_clip
            v_clipped = old + (vd - old).clamp(-value_clip, value_clip)
            unclipped, clipped = (vd - ret) ** 2, (v_clipped - ret) ** 2
            use_clipped = clipped > unclipped
            # NOTE: the count from the values at the weights before the step (`vd` comes from weights
            # restored by subtraction: a near tie of the two terms could flip on the last bit)
            v_clipped0 = old + (values0 - old).clamp(-value_clip, value_clip)
            counted = (v_clipped0 - ret) ** 2 > (values0 - ret) ** 2
            g_v = torch.where(use_clipped, (v_clipped - ret) * inside, vd - ret)  # d 0.5 max(.,.) / dv
            lp_grad = torch.where(mask, w * g_pol, 0.0)
            v_grad = torch.where(mask, vf_coef * w * g_v, 0.0)
            torch.autograd.backward([lp, v], [lp_grad, v_grad])
            holder.update(policy=(w * per_token)[mask].sum().item(),
                          value=(w * 0.5 * torch.maximum(unclipped, clipped))[mask].sum().item(),
                          vclip=counted[mask].float().mean().item())

        assert_update_is(delta, module, grads_of)
        assert 0 < holder["vclip"] < 1  # both branches of the value clip are exercised
        assert logged["policy_loss"] == pytest.approx(holder["policy"], rel=1e-4, abs=1e-6)
        assert logged["value_loss"] == pytest.approx(holder["value"], rel=1e-4)
        assert logged["loss"] == pytest.approx(holder["policy"] + vf_coef * holder["value"], rel=1e-4, abs=1e-6)
        assert logged["value_clip_fraction"] == pytest.approx(holder["vclip"], abs=1e-6)
    finally:
        trainer.close()


# ---------------------------------------------------------------------------- multi-turn episodes
class ToolEcho:
    """Two model turns around a tool message; each turn earns the share of digits in its text (varies
    inside a group), so advantages are non-zero and the tool's tokens sit inside every trajectory."""

    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turn += 1
        score = sum(ch.isdigit() for ch in action) / max(len(action), 1)
        if self.turn == 1:
            return [{"role": "tool", "content": "4321"}], score, False
        return None, score, True


@pytest.mark.parametrize(
    "algorithm, agg, clip_low, clip_high",
    [("grpo", "seq_mean_token_mean", 0.2, 0.2), ("dr_grpo", "seq_mean_token_sum_norm", 0.2, 0.2),
     ("dapo", "token_mean", 0.2, 0.28)],
)
def test_agent_grpo_update_counts_only_model_tokens(tmp_path, algorithm, agg, clip_low, clip_high):
    """Episodes with tool turns (`AgentGRPOTrainer`): the update equals the hand gradient whose loss, KL and
    aggregation weights count the model's tokens only (Dr. GRPO divides by max_turns x max_new_tokens);
    the logged entropy, response length and parity probe ignore the tool's tokens too."""
    from trainers.agent_grpo import AgentGRPOConfig, AgentGRPOTrainer
    from trainers.calculator import make_calculator_tokenizer

    beta, turns = 0.5, 2
    tok = make_calculator_tokenizer()
    dataset = [{"prompt": f"{i:02d}+{i + 3:02d}"} for i in range(8)]
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    config = AgentGRPOConfig(**common_settings(tmp_path, algorithm=algorithm, beta=beta, max_turns=turns))
    trainer = AgentGRPOTrainer(model, tok, ToolEcho, dataset, config)
    try:
        data, metrics = trainer.collect()
        mask = data["loss_mask"]
        t = data["completion_ids"].shape[1]
        tool_tokens = data["attention_mask"][:, -t:].bool() & ~mask  # [N, T] in the trajectory, not sampled
        assert tool_tokens.sum(1).gt(0).float().mean() > 0.5 and mask.any()
        assert (data["rollout_logprobs"][tool_tokens] == 0).all()
        # NOTE: the tool's tokens have no rollout logprob; counted, the probe would be of order 1
        assert metrics["logprob_mismatch_max"] < 1e-4
        assert metrics["response_length"] == pytest.approx(mask.sum(1).float().mean().item())
        data["old_logprobs"] = perturbed(data, "old_logprobs", 0.4, seed=1)
        data["ref_logprobs"] = perturbed(data, "ref_logprobs", 0.4, seed=2)
        delta, logged = sgd_step(trainer, data)
        policy = trainer.policy
        for name, p in policy.named_parameters():
            p.data -= delta[name]
        if agg == "seq_mean_token_sum_norm":
            w = mask.float() / (mask.shape[0] * turns * MAX_NEW)
        else:
            w = aggregation_weights(mask, agg)
        holder = {}

        def grads_of():
            lp = token_logprobs_by_hand(policy, data)
            g_pol, per_token, clipped = policy_grad_by_hand(lp.detach(), data["old_logprobs"], data["advantages"], mask,
                                                            clip_low, clip_high)
            log_ratio = data["ref_logprobs"] - lp.detach()
            k3 = torch.exp(log_ratio) - log_ratio - 1
            lp.backward(torch.where(mask, w * (g_pol + beta * (1 - torch.exp(log_ratio))), 0.0))
            holder.update(policy=(w * per_token)[mask].sum().item(), kl=(w * k3)[mask].sum().item())

        assert_update_is(delta, policy, grads_of)
        assert logged["kl_loss"] == pytest.approx(holder["kl"], rel=1e-4)
        assert logged["loss"] == pytest.approx(holder["policy"] + beta * holder["kl"], rel=1e-4, abs=1e-6)
        # the entropy metric: softmax(logits / T) over model tokens only
        with torch.no_grad():
            logits = completion_forward(policy, data).logits[:, :-1].float() / data["temperatures"][:, None, None]
            entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)  # [N, T]
            assert metrics["entropy"] == pytest.approx(entropy[mask].mean().item(), rel=1e-4)
    finally:
        trainer.close()
