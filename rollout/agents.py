"""Multi-turn episodes as exact token trajectories: `Environment`, `ChatBridge`, `run_episodes`.

An episode alternates model turns and environment turns. The trajectory is kept as token ids from start
to end and is never re-tokenised: the model's turns are the ids it sampled, and each environment turn is
rendered by a `ChatBridge` that appends only the new turn's tokens (the chat template's rendering of the
new messages after a fixed anchor conversation), closing the model's turn the way the template closes an
assistant message. Re-applying the chat template to the decoded conversation would give other ids
(special tokens dropped by decoding, text that tokenises differently), so the trainer would score tokens
that were never sampled.

Each turn submits every live episode's whole context (first prompt + every turn so far) as one request:
the prefix cache serves the pages of earlier turns (full pages of `page_size` tokens), so a turn computes
about its new tokens only. Samples of a group run concurrently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rollout.api.batch import RolloutBatch
from rollout.api.chat import chat_template_ids
from rollout.sampling.seeding import derive_seed
from rollout.sampling_params import temperatures

Observation = list[Mapping[str, Any]] | str  # chat messages, or plain text


class Action(str):
    """The model's turn as text (special tokens skipped); `.ids` holds the exact token ids it sampled."""

    ids: list[int]

    def __new__(cls, text: str, ids: Sequence[int]) -> Action:
        self = super().__new__(cls, text)
        self.ids = list(ids)
        return self


class Environment(Protocol):
    """One episode's world. `reset(row)` returns the first observation (chat messages or text);
    `step(action)` returns `(observation | None, reward, done)` for the model's turn `action`."""

    def reset(self, row: Any) -> Observation: ...

    def step(self, action: Action) -> tuple[Observation | None, float, bool]: ...


class ChatBridge:
    """Renders observations as token ids that extend a trajectory without re-tokenising it.

    Args:
        tokenizer: the policy's tokenizer (a chat template for message observations).
        stop_ids: the ids that end a model turn (the engine's EOS ids); the first is used to close a turn
            the model did not end itself (cut by `max_new_tokens`).
    """

    ANCHOR = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})

    def __init__(self, tokenizer, stop_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = [int(t) for t in stop_ids]
        self._closing: list[int] | None = None

    def first(self, observation: Observation) -> list[int]:
        """The first prompt: messages through the chat template (ready for the assistant), or text."""
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=True)["input_ids"])
        return chat_template_ids(self.tokenizer, list(observation))

    def next(self, observation: Observation, model_ids: Sequence[int]) -> list[int]:
        """The tokens after a model turn `model_ids`: the end of the assistant message, then the new
        observation (and the next assistant header for messages)."""
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=False)["input_ids"])
        ended = bool(model_ids) and model_ids[-1] in self.stop_ids
        closing = self.closing()
        head = closing if ended else [self.stop_ids[0], *closing] if self.stop_ids else closing
        return head + self._delta(list(observation))

    def closing(self) -> list[int]:
        """What the template puts after an assistant message's stop token (e.g. a newline)."""
        if self._closing is None:
            base = chat_template_ids(self.tokenizer, list(self.ANCHOR), add_generation_prompt=False)
            last = max((i for i, t in enumerate(base) if t in self.stop_ids), default=None)
            if last is None:
                raise ValueError("the chat template does not end an assistant message with a stop token; "
                                 "pass stop_ids that the template uses")
            self._closing = base[last + 1:]
        return self._closing

    def _delta(self, messages: list[Mapping[str, Any]]) -> list[int]:
        base = chat_template_ids(self.tokenizer, list(self.ANCHOR), add_generation_prompt=False)
        full = chat_template_ids(self.tokenizer, [*self.ANCHOR, *messages], add_generation_prompt=True)
        if full[: len(base)] != base:
            raise ValueError("the chat template renders earlier messages differently once more follow; the bridge "
                             "cannot append a turn without re-tokenising (use text observations)")
        return full[len(base):]


@dataclass
class _Episode:
    index: int  # row of the batch: prompt i, sample j -> i * group_size + j
    env: Environment
    prompt: list[int]
    temperature: float
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    model: list[bool] = field(default_factory=list)  # per token: sampled by the model
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    finish_reason: str = "max_turns"
    routes: torch.Tensor | None = None  # [len(prompt) + tokens up to its last model turn, L, k] (routed experts)


def run_episodes(
    engine,
    env_factory: Callable[[], Environment],
    rows: Sequence[Any],
    group_size: int = 1,
    max_turns: int = 4,
    temps: float | Sequence[float] = 1.0,
    max_new_tokens: int = 64,
    max_tokens: int | None = None,
    seed: int | None = None,
    bridge: ChatBridge | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    return_routed_experts: bool = False,
) -> RolloutBatch:
    """Run `group_size` episodes per row (each its own `env_factory()`), at most `max_turns` model turns
    and `max_tokens` trajectory tokens after the first prompt; returns a `RolloutBatch` whose
    `completion_ids` hold every turn after the first prompt (model and environment tokens in order),
    `loss_mask [N, T]` 1 on model tokens, `logprobs` on model tokens (0 elsewhere), `rewards [N]` (the
    sum of the environment's rewards) and `num_turns [N]`. `engine` is a `RolloutEngine` with a tokenizer.
    With `seed`, turn k is a `generate` call seeded `derive_seed(seed, k)` over the live episodes (one
    group each, in order; `rollout.sampling.seeding`): a call is reproducible, but an episode's stream
    depends on its position among the episodes still running at turn k; `top_k` / `top_p` filter every model turn as in
    `RolloutEngine.generate`. `return_routed_experts` (an MoE policy) adds `routed_experts [N, P + T, L, k]`
    aligned with `input_ids`: each episode's routes from its last turn's request, which covers the whole context
    (earlier turns' routes come back with their prefix-cache pages or were recomputed); -1 at padding, at the
    last sampled token and at environment tokens no later turn ran."""
    if engine.tokenizer is None and bridge is None:
        raise ValueError("run_episodes needs a tokenizer: build the RolloutEngine with tokenizer=")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    temps = temperatures(temps, len(rows))
    eos = engine.generation_config.eos_token_id
    bridge = bridge or ChatBridge(engine.tokenizer, [eos] if isinstance(eos, int) else list(eos or []))
    episodes = []
    for i, row in enumerate(rows):
        for j in range(group_size):
            env = env_factory()
            episodes.append(_Episode(i * group_size + j, env, bridge.first(env.reset(row)), temps[i]))
    for turn in range(max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            break
        budget = [max_new_tokens if max_tokens is None else min(max_new_tokens, max_tokens - len(e.tokens))
                  for e in live]
        out = engine.generate([e.prompt + e.tokens for e in live], temps=[e.temperature for e in live],
                              max_new_tokens=max(1, min(budget)) if max_tokens is not None else max_new_tokens,
                              seed=None if seed is None else derive_seed(seed, turn), top_k=top_k, top_p=top_p,
                              return_routed_experts=return_routed_experts)
        width = out.prompt_ids.shape[1]
        for k, e in enumerate(live):
            n = int(out.completion_mask[k].sum())
            ids = out.completion_ids[k, :n].tolist()
            if return_routed_experts:  # NOTE: this turn's context (left-padded in `out`), then its n tokens
                context = len(e.prompt) + len(e.tokens)
                e.routes = out.routed_experts[k, width - context : width + n].cpu()
            e.tokens += ids
            e.model += [True] * n
            e.logprobs += out.logprobs[k, :n].tolist()
            e.turns += 1
            text = engine.tokenizer.decode(ids, skip_special_tokens=True) if engine.tokenizer is not None else ""
            observation, reward, done = e.env.step(Action(text, ids))
            e.reward += float(reward)
            if done or observation is None:
                e.done, e.finish_reason = True, "done"
                continue
            if max_tokens is not None and len(e.tokens) >= max_tokens:
                e.done, e.finish_reason = True, "length"
                continue
            if turn + 1 < max_turns:  # NOTE: no dangling observation after the last model turn
                new = bridge.next(observation, ids)
                e.tokens += new
                e.model += [False] * len(new)
                e.logprobs += [0.0] * len(new)
    return _to_batch(episodes, engine.pad_token_id, group_size, engine.policy_version, engine.device,
                     engine.tokenizer, return_routed_experts)


def _to_batch(episodes: list[_Episode], pad: int, group_size: int, version: int, device: torch.device,
              tokenizer, routed: bool = False) -> RolloutBatch:
    n = len(episodes)
    p_len = max((len(e.prompt) for e in episodes), default=0)
    t_len = max((len(e.tokens) for e in episodes), default=0)
    prompt_ids = torch.full((n, p_len), pad, dtype=torch.long)  # [N, P] left-padded
    prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
    completion_ids = torch.full((n, t_len), pad, dtype=torch.long)  # [N, T] right-padded
    completion_mask = torch.zeros((n, t_len), dtype=torch.long)
    loss_mask = torch.zeros((n, t_len), dtype=torch.long)  # [N, T] 1 on model tokens
    logprobs = torch.zeros((n, t_len), dtype=torch.float32)
    for e in episodes:
        r, p, t = e.index, len(e.prompt), len(e.tokens)
        prompt_ids[r, p_len - p:] = torch.tensor(e.prompt)
        prompt_mask[r, p_len - p:] = 1
        if t:
            completion_ids[r, :t] = torch.tensor(e.tokens)
            completion_mask[r, :t] = 1
            loss_mask[r, :t] = torch.tensor(e.model, dtype=torch.long)
            logprobs[r, :t] = torch.tensor(e.logprobs, dtype=torch.float32)
    texts = None
    if tokenizer is not None:
        texts = [tokenizer.decode(e.tokens, skip_special_tokens=True) for e in episodes]
    batch = RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, logprobs=logprobs,
        group_ids=torch.arange(n) // group_size,
        temperatures=torch.tensor([e.temperature for e in episodes], dtype=torch.float32),
        finish_reasons=[e.finish_reason for e in episodes], policy_version=version, completions_text=texts,
        loss_mask=loss_mask, rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        num_turns=torch.tensor([e.turns for e in episodes], dtype=torch.long),
        routed_experts=_routes(episodes, p_len, t_len) if routed else None,
    )
    return batch.to(device)


def _routes(episodes: list[_Episode], p_len: int, t_len: int) -> torch.Tensor:
    """`[N, p_len + t_len, L, k]` int16: each episode's routes laid out as `input_ids`, -1 where none ran."""
    shape = episodes[0].routes.shape[1:]
    out = torch.full((len(episodes), p_len + t_len, *shape), -1, dtype=torch.int16)
    for e in episodes:
        p = len(e.prompt)
        out[e.index, p_len - p : p_len] = e.routes[:p]
        out[e.index, p_len : p_len + len(e.routes) - p] = e.routes[p:]
    return out
