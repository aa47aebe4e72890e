"""Multi-turn episodes (`rollout.agents`): exact token trajectories, masks, prefix reuse across turns."""

from __future__ import annotations

import pytest
import torch
from support.chat_model import make_chat_tokenizer, make_tiny_chat_model
from support.tiny_models import teacher_forced_logprobs

from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.agents import Action, ChatBridge, run_episodes
from rollout.api.chat import chat_template_ids


class Counter:
    """Answers every model turn with a tool message; done after `turns` model turns, reward = turns seen."""

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.seen, self.actions = turns, 0, []

    def reset(self, row):
        self.seen, self.actions = 0, []
        return [{"role": "user", "content": f"count {row}"}]

    def step(self, action: Action):
        assert isinstance(action, str) and isinstance(action.ids, list)
        self.actions.append(action)
        self.seen += 1
        done = self.seen >= self.turns
        return (None if done else [{"role": "tool", "content": f"got {len(action.ids)}"}]), 1.0, done


@pytest.fixture(scope="module")
def chat():
    tokenizer = make_chat_tokenizer()
    model = make_tiny_chat_model(tokenizer, seed=3)
    return model, tokenizer


def _engine(model, tokenizer, **config):
    cbc = ContinuousBatchingConfig(page_size=16, num_blocks=256, **config)
    return RolloutEngine(model, tokenizer=tokenizer, config=cbc)


def test_model_tokens_are_exact_and_scored_like_a_teacher_forced_forward(chat):
    """Every model token's logprob equals a teacher-forced forward over the whole concatenated trajectory;
    environment tokens carry no logprob and no loss."""
    model, tokenizer = chat
    with _engine(model, tokenizer) as engine:
        batch = run_episodes(engine, lambda: Counter(3), ["a", "b"], group_size=2, max_turns=3, temps=1.0,
                             max_new_tokens=12, seed=0)
    assert batch.completion_ids.shape[0] == 4 and batch.rewards.tolist() == [3.0] * 4
    assert batch.num_turns.tolist() == [3] * 4
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    for r in range(4):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
        n = int(batch.completion_mask[r].sum())
        tokens = batch.completion_ids[r, :n].tolist()
        model_tok = batch.loss_mask[r, :n].bool()
        assert model_tok.any() and not model_tok.all()  # NOTE: both kinds of turns are there
        expected = teacher_forced_logprobs(model, prompt, tokens)  # [n]
        got = batch.logprobs[r, :n]
        assert torch.allclose(got[model_tok], expected[model_tok], atol=1e-4), (got, expected)
        assert (got[~model_tok] == 0).all()
        assert batch.trained_mask[r, :n].tolist() == model_tok.long().tolist()


def test_the_bridge_appends_tokens_and_re_templating_would_drift(chat):
    """The trajectory is the first prompt + the sampled ids + the bridge's tokens for each observation,
    never a re-rendering; re-applying the template to the decoded conversation gives other ids for at
    least one episode (special tokens the model sampled vanish in decoding), so drift is real."""
    model, tokenizer = chat
    envs = []

    def factory():
        envs.append(Counter(2))
        return envs[-1]

    with _engine(model, tokenizer) as engine:
        batch = run_episodes(engine, factory, list(range(6)), group_size=1, max_turns=2, temps=1.0,
                             max_new_tokens=10, seed=1)
    bridge = ChatBridge(tokenizer, [tokenizer.eos_token_id])
    drifted = 0
    for r, env in enumerate(envs):
        n = int(batch.completion_mask[r].sum())
        tokens = batch.completion_ids[r, :n].tolist()
        first_action = env.actions[0]
        # NOTE: exactness: sampled ids, then the bridge's rendering of the tool message, then turn two
        expected_head = first_action.ids + bridge.next([{"role": "tool", "content": f"got {len(first_action.ids)}"}],
                                                       first_action.ids)
        assert tokens[: len(expected_head)] == expected_head
        assert tokens[len(expected_head):] == env.actions[1].ids
        messages = [{"role": "user", "content": f"count {r}"}, {"role": "assistant", "content": str(first_action)},
                    {"role": "tool", "content": f"got {len(first_action.ids)}"},
                    {"role": "assistant", "content": str(env.actions[1])}]
        prompt = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
        retemplated = chat_template_ids(tokenizer, messages, add_generation_prompt=False)
        drifted += retemplated[: len(prompt) + n] != prompt + tokens
    assert drifted >= 1


def test_turns_reuse_the_previous_turns_kv(chat):
    """Over a 4-turn episode the engine computes about the trajectory once (prefix cache hits on the
    earlier turns' full pages), not the growing history every turn."""
    model, tokenizer = chat
    with _engine(model, tokenizer) as engine:
        before = engine.cache_stats()
        batch = run_episodes(engine, lambda: Counter(4), ["x"], group_size=1, max_turns=4, temps=1.0,
                             max_new_tokens=24, seed=2)
        after = engine.cache_stats()
    prompt = int(batch.prompt_mask.sum())
    total = prompt + int(batch.completion_mask.sum())
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert batch.num_turns.item() == 4 and cached > 0
    # NOTE: each turn recomputes at most its context's last partial page (16 tokens) beyond the new tokens
    assert computed <= total + 4 * 16, (computed, total)
    # NOTE: computed + cached is every turn's whole context: what recomputing the history would cost
    assert computed < (computed + cached) / 2, (computed, cached)


def test_text_observations_and_refusals(chat):
    model, tokenizer = chat

    class Echo:
        def reset(self, row):
            return "say:"

        def step(self, action):
            return " ok", 0.5, False

    with _engine(model, tokenizer) as engine:
        batch = run_episodes(engine, Echo, ["r"], max_turns=2, temps=0.0, max_new_tokens=5)
        assert batch.rewards.tolist() == [1.0] and batch.finish_reasons == ["max_turns"]
        n = int(batch.completion_mask.sum())
        env_ids = batch.completion_ids[0, :n][~batch.loss_mask[0, :n].bool()].tolist()
        assert env_ids == tokenizer(" ok", add_special_tokens=False)["input_ids"]
        with pytest.raises(ValueError, match="group_size"):
            run_episodes(engine, Echo, ["r"], group_size=0)
        with pytest.raises(ValueError, match="temps"):
            run_episodes(engine, Echo, ["r", "s"], temps=[1.0])


class WideTokenizer:
    """The chat tokenizer over a tiny model with a larger vocabulary: ids past its vocabulary decode to nothing."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.chat_template = tokenizer.chat_template

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self.tok.apply_chat_template(*args, **kwargs)

    def decode(self, ids, **kwargs):
        return self.tok.decode([i for i in ids if i < len(self.tok)], **kwargs)

    def batch_decode(self, rows, **kwargs):
        return [self.decode(r, **kwargs) for r in rows]


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_models_reuse_earlier_turns_exactly(arch):
    """Mistral (every layer slides) and Gemma 2 (sliding beside full attention): the prefix cache serves
    the earlier turns across calls (each layer group its own pages, a sliding group only its window's),
    and the model tokens' logprobs still equal a teacher-forced forward over the whole trajectory."""
    from support.tiny_models import make_model

    model = make_model(arch)
    tokenizer = WideTokenizer(make_chat_tokenizer())
    with _engine(model, tokenizer) as engine:
        before = engine.cache_stats()
        batch = run_episodes(engine, lambda: Counter(4), ["x", "y"], group_size=1, max_turns=4, temps=1.0,
                             max_new_tokens=20, seed=4)
        after = engine.cache_stats()
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert batch.num_turns.tolist() == [4, 4] and cached > 0
    assert computed < (computed + cached) / 2, (computed, cached)
    for r in range(2):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
        n = int(batch.completion_mask[r].sum())
        model_tok = batch.loss_mask[r, :n].bool()
        expected = teacher_forced_logprobs(model, prompt, batch.completion_ids[r, :n].tolist())
        assert torch.allclose(batch.logprobs[r, :n][model_tok], expected[model_tok], atol=1e-4)


def test_the_bridge_takes_content_parts_as_the_server_does(chat):
    """An environment's messages with content as text parts render as the joined text (the demo's string
    template would raise on a list); a non-text part is refused naming it."""
    from rollout.api.content import ContentPartError

    _, tokenizer = chat
    bridge = ChatBridge(tokenizer, [tokenizer.eos_token_id])
    parts = [{"type": "text", "text": "12+"}, {"type": "text", "text": "34="}]
    assert bridge.first([{"role": "user", "content": parts}]) == bridge.first([{"role": "user", "content": "12+\n34="}])
    model_ids = tokenizer("7", add_special_tokens=False)["input_ids"]
    assert (bridge.next([{"role": "tool", "content": parts}], model_ids)
            == bridge.next([{"role": "tool", "content": "12+\n34="}], model_ids))
    with pytest.raises(ContentPartError, match=r"messages\[0\]\.content\[1\] is a 'input_audio' part"):
        bridge.first([{"role": "user", "content": [parts[0], {"type": "input_audio", "input_audio": {}}]}])
