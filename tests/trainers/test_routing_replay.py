"""Routing replay (R3) in the trainers on a tiny Qwen3-MoE addition policy: `GRPOConfig(routing_replay=True)`
logs `routing_mismatch_fraction` and keeps the parity probe at float error; under replay the experts the
trainer's forward runs are the recorded ones even when its router weights have moved, with the router still
getting its gradient through the gate weights; the agent trainer replays its multi-turn episodes' routes."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from support.routes import assert_row_routes, batch_rows
from support.training import build_tiny_moe_model, digit_share

from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.agents import run_episodes
from rollout.model.routers import moe_routers
from trainers import GRPOConfig, GRPOTrainer
from trainers.agent_grpo import AgentGRPOConfig, AgentGRPOTrainer
from trainers.calculator import calculator_problems, make_calculator_tokenizer
from trainers.common import completion_forward
from trainers.rollouts import batch_tensors
from trainers.routing_replay import RoutingReplay
from trainers.tasks import AdditionTask, addition_reward, make_addition_tokenizer

CFG = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256)


@pytest.fixture(scope="module")
def tokenizer():
    return make_addition_tokenizer()


def rollouts(model, tokenizer):
    prompts = ["123+456=", "7+8=", "99+1="]
    with RolloutEngine(model, tokenizer=tokenizer, config=CFG) as eng:
        return eng.generate(prompts, temps=1.0, group_size=2, max_new_tokens=6, seed=0, return_routed_experts=True)


def experts_run(model, data, replay: RoutingReplay | None, gates: list | None = None) -> list[torch.Tensor]:
    """The expert indices each MoE layer's experts module was called with, in one teacher-forced forward
    (`gates`: gets each router's (logits, gate weights) as the experts received them)."""
    seen: list[torch.Tensor] = []
    forcing = contextlib.nullcontext() if replay is None else replay.forcing(model, data["routed_experts"])
    with forcing:  # NOTE: the forcing hooks first, so the recording hooks below see what the experts get
        hooks = [m.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
                 for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
        if gates is not None:
            hooks += [r.register_forward_hook(lambda mod, args, out: gates.append((out[0].detach(), out[1].detach())))
                      for r in moe_routers(model)]
        try:
            completion_forward(model, data)
        finally:
            for h in hooks:
                h.remove()
    return seen


def test_replay_runs_the_recorded_experts_after_the_router_moved(tokenizer):
    model = build_tiny_moe_model(tokenizer).eval()
    batch = rollouts(model, tokenizer)
    data = batch_tensors(batch)
    routes = data["routed_experts"]  # [N, S, L, k]
    valid = (routes >= 0).all(-1)  # [N, S, L]
    assert valid.any(-1).sum() == batch.attention_mask.sum() - len(batch)  # every token ran, but each row's last

    moved = copy.deepcopy(model)
    with torch.no_grad():
        for router in moe_routers(moved):
            router.weight.add_(torch.randn_like(router.weight) * 0.5)
    own = experts_run(moved, data, None)
    replay = RoutingReplay(True)
    metrics: dict[str, float] = {}
    gates: list = []
    with replay.measure(metrics):
        forced = experts_run(moved, data, replay, gates)
    for layer, (mine, used) in enumerate(zip(own, forced, strict=True)):
        want = routes[:, :, layer].reshape(-1, 2).long()
        ok = valid[:, :, layer].reshape(-1)
        assert torch.equal(used[ok].sort(-1).values, want[ok].sort(-1).values), layer
        # NOTE: R3's gate: the moved router's softmax over all experts, at the recorded ones, renormalised
        logits, weights = gates[layer]
        picked = logits.softmax(-1).gather(-1, used)
        torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))
        if layer == 0:  # NOTE: no recorded route: the router's own choice (same inputs in the first layer only)
            assert torch.equal(used[~ok], mine[~ok])
        assert not torch.equal(mine[ok].sort(-1).values, want[ok].sort(-1).values)  # the moved router disagrees
    assert 0.2 < metrics["routing_mismatch_fraction"] <= 1.0

    # the router still learns: its gate weights over the recorded experts carry the gradient
    moved.train()
    with replay.forcing(moved, routes):
        loss = completion_forward(moved, data).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(moved))


def test_replay_with_the_rollout_weights_changes_nothing(tokenizer):
    model = build_tiny_moe_model(tokenizer).eval()
    data = batch_tensors(rollouts(model, tokenizer))
    replay = RoutingReplay(True)
    metrics: dict[str, float] = {}
    with torch.no_grad():
        plain = completion_forward(model, data).logits
        with replay.measure(metrics), replay.forcing(model, data["routed_experts"]):
            forced = completion_forward(model, data).logits
    assert metrics["routing_mismatch_fraction"] == 0.0
    assert torch.equal(plain, forced)


def test_grpo_with_routing_replay_logs_the_mismatch_at_parity(tokenizer, tmp_path):
    dataset = AdditionTask(num_digits=2, seed=0).to_dataset(32)
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6,
                        learning_rate=5e-3, log_stdout=False, progress=False, engine_config=CFG, routing_replay=True)
    with GRPOTrainer(build_tiny_moe_model(tokenizer), tokenizer, [addition_reward, digit_share], dataset,
                     config) as trainer:
        history = trainer.train()
        forced = trainer.routing.forced
    for metrics in history:
        assert 0.0 <= metrics["routing_mismatch_fraction"] <= 0.01
        assert metrics["logprob_mismatch_max"] <= 1e-4  # NOTE: the second step's rollout ran the updated weights
    assert forced >= 2 * 2 * 2  # both layers, recomputation and loss passes, both steps


def test_routing_replay_off_asks_the_engine_for_nothing(tokenizer, tmp_path):
    dataset = AdditionTask(num_digits=2, seed=0).to_dataset(32)
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4,
                        log_stdout=False, progress=False, engine_config=CFG)
    with GRPOTrainer(build_tiny_moe_model(tokenizer), tokenizer, [addition_reward], dataset, config) as trainer:
        metrics = trainer.step()
        assert trainer.engine.manager.core.runner.routes is None
    assert "routing_mismatch_fraction" not in metrics


class ToolEveryTurn:
    """An environment that answers every model turn with a tool message (so each episode runs `max_turns` turns),
    rewarding turns of odd length."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        return [{"role": "tool", "content": "42"}], float(len(action.ids) % 2), False


def test_episode_routes_cover_every_turn_and_equal_hf(keep_rng):
    tok = make_calculator_tokenizer()
    model = build_tiny_moe_model(tok).eval()
    rows = calculator_problems(2, num_digits=4, seed=1)
    with RolloutEngine(model, tokenizer=tok, config=CFG) as eng:
        batch = run_episodes(eng, ToolEveryTurn, rows, group_size=2, max_turns=3, max_new_tokens=5, seed=0,
                             return_routed_experts=True)
        plain = run_episodes(eng, ToolEveryTurn, rows, group_size=1, max_turns=2, max_new_tokens=3, seed=0)
    assert plain.routed_experts is None
    assert (batch.num_turns == 3).all() and batch.routed_experts.shape[:2] == batch.input_ids.shape
    env_tokens = (batch.completion_mask - batch.loss_mask).sum()
    assert env_tokens > 0  # NOTE: two environment turns per row, run through the model by the next turn
    for tokens, routes in batch_rows(batch):  # every position but the last ran, with HF's top-k
        assert_row_routes(model, tokens, routes)


def test_agent_trainer_replays_the_episodes_routes(tmp_path, keep_rng):
    tok = make_calculator_tokenizer()
    config = AgentGRPOConfig(output_dir=str(tmp_path), max_steps=1, prompts_per_step=2, group_size=2, max_turns=2,
                             max_new_tokens=4, learning_rate=5e-3, log_stdout=False, progress=False, engine_config=CFG,
                             routing_replay=True)
    with AgentGRPOTrainer(build_tiny_moe_model(tok), tok, ToolEveryTurn, calculator_problems(8, num_digits=4, seed=1),
                          config) as trainer:
        metrics = trainer.step()
        forced = trainer.routing.forced
    assert 0.0 <= metrics["routing_mismatch_fraction"] <= 0.01
    assert metrics["logprob_mismatch_max"] <= 1e-4 and metrics["num_turns"] == 2.0
    assert forced >= 2 * 2  # both layers, recomputation and loss passes
