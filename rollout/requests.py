"""Request state, `RequestStatus` and `GenerationOutput` (a request carries its bound `SamplingParams`). Pure
Python: no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rollout.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    PENDING = "pending"  # submitted, not yet scheduled
    PREFILLING = "prefilling"  # computing its prompt (possibly in chunks)
    DECODING = "decoding"  # generating one token per step
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


@dataclass
class GenerationOutput:
    """What a request delivers: its final result, or a partial chunk when streaming.

    `logprobs` holds one fp32 value per generated token when logprobs are on, else None.
    `finish_reason` is "stop", "length", "cancelled" or "error" once final, None for a partial chunk.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    policy_version: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed
    versions: list[int] | None = None  # [num generated] the policy_version that sampled each token
    # NOTE: scoring (teacher-forced) fields, None unless asked for: logprobs of the given tokens
    # (prompt then forced) from `score_from` on, and top-k logprobs / ids of given and generated tokens.
    scores: list[float] | None = None  # [G - score_from]
    score_top_logprobs: list[list[float]] | None = None  # [G - score_from, k]
    score_top_ids: list[list[int]] | None = None  # [G - score_from, k]
    score_ranks: list[int] | None = None  # [G - score_from] 1-based rank of each given token (with k > 0)
    top_logprobs: list[list[float]] | None = None  # [num generated, k]
    top_ids: list[list[int]] | None = None  # [num generated, k]
    top_ranks: list[int] | None = None  # [num generated] 1-based rank of each generated token (with top k)
    # NOTE: with return_sampling_mask, per generated token the ids the sampler could have drawn (after the
    # logits processors, top-k, top-p and min-p: `rollout.sampling.sampler.support`); [argmax] for a greedy row
    sampling_masks: list[list[int]] | None = None
    # NOTE: with return_routed_experts, an int16 tensor [prompt + forced + generated, L, k]: the experts each MoE
    # layer chose at every position that ran through the model, -1 where none ran (the last sampled token).
    routed_experts: Any = None

    def is_finished(self) -> bool:
        return self.status.is_final


@dataclass(eq=False)
class Request:
    """Engine-side state of one request. Only the scheduler and the engine core mutate it.

    `token_ids` is prompt + generated; `num_computed_tokens` of them have KV in the cache.
    A request needs the model for `num_tokens - num_computed_tokens` more tokens before it samples.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    streaming: bool = False
    return_logprobs: bool = False
    arrival: int = 0  # submission order, used by fifo and preemption
    token_ids: list[int] = field(init=False)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy_version that sampled each generated token
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    page_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    policy_version: int = 0
    num_preemptions: int = 0
    # NOTE: most tokens it had computed when it was last preempted (what lies below is recomputation)
    high_water: int = 0
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full pages so far
    num_registered_pages: int = 0  # leading pages already offered to the prefix cache
    stale_kv: bool = False  # its KV predates a weight change: never offered to the prefix cache
    # NOTE: pages held in the CPU offload buffer while preempted (empty unless offloading).
    offloaded: list[int] = field(default_factory=list)
    # NOTE: set by a fork whose partial prompt page copied the first `slots` slots of its leader's page:
    # (logical page, the page copied from in each layer group, slots). The fork holds a reference to those
    # pages (nothing writes those slots again) until its pages are released; the decode kernel reads the
    # slots there once for all the forks of one group (`rollout.model.runner`,
    # `rollout/kernels/csrc/decode_attention.cpp`).
    fork_alias: tuple[int, list[int], int] | None = None
    # Scoring: `forced_ids` follow the prompt as given tokens (teacher-forced, never sampled); with
    # `score_from` set, the logprob of every given token from that index on is recorded (by position, so
    # a recomputation after preemption overwrites it); `top_logprobs` k > 0 adds the top k of each scored
    # and each generated position. `max_new_tokens` may be 0 for a request that only scores.
    forced_ids: list[int] = field(default_factory=list)
    score_from: int | None = None
    top_logprobs: int = 0
    scores: dict[int, tuple] = field(default_factory=dict)  # position -> (logprob, top values, top ids, rank)
    top: list[tuple[list[float], list[int], int]] = field(default_factory=list)  # per generated token (+ rank)
    masks: list[list[int]] = field(default_factory=list)  # with sampling.return_sampling_mask: each token's support
    routes: Any = None  # NOTE: its `rollout.model.routes.RequestRoutes` when it asked for routed experts
    # NOTE: LoRA (`rollout.model.lora`): the adapter slot it runs under (None: the base model), and the salt of its
    # prefix-cache keys (the adapter and its version), so KV is shared only between requests of one adapter version
    lora_slot: int | None = None
    cache_salt: bytes = b""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids) + list(self.forced_ids)

    @property
    def num_given_tokens(self) -> int:
        """Prompt plus forced tokens: positions below `num_given_tokens - 1` predict a given token."""
        return len(self.prompt_ids) + len(self.forced_ids)

    def schedulable(self, computed: int) -> int:
        """Tokens its next chunk may compute after `computed`: a row with forced tokens stops once one
        token short of its prompt's end, where rows sharing its prompt can fork it while it goes on."""
        end = len(self.prompt_ids) - 1
        if self.forced_ids and computed < end:
            return end - computed
        return len(self.token_ids) - computed

    @property
    def max_reused_tokens(self) -> int:
        """Most leading tokens whose KV may come from the prefix cache or a fork: never the last token, and
        never a position whose logits are scored."""
        if self.score_from is None:
            return self.num_tokens - 1
        return min(self.num_tokens - 1, self.score_from - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token: int, logprob: float | None, version: int = 0) -> str | None:
        """Add a token sampled under policy `version`; returns why it stops the request, "stop" (an EOS or stop token)
        or "length" (the budget used), or None."""
        self.token_ids.append(token)
        self.generated.append(token)
        self.versions.append(version)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.eos_token_ids:
            return "stop"
        if len(self.generated) >= self.max_new_tokens:
            return "length"
        return None

    def to_output(self) -> GenerationOutput:
        out = self._output()
        if self.score_from is not None:
            positions = range(self.score_from - 1, self.num_given_tokens - 1)
            rows = [self.scores.get(p, (0.0, [], [], None)) for p in positions]
            out.scores = [r[0] for r in rows]
            if self.top_logprobs:
                out.score_top_logprobs, out.score_top_ids = [r[1] for r in rows], [r[2] for r in rows]
                out.score_ranks = [r[3] for r in rows]
        if self.top_logprobs:
            out.top_logprobs, out.top_ids = [t[0] for t in self.top], [t[1] for t in self.top]
            out.top_ranks = [t[2] for t in self.top]
        if self.sampling.return_sampling_mask:
            out.sampling_masks = [list(m) for m in self.masks]
        if self.routes is not None and self.status.is_final:
            out.routed_experts = self.routes.tensor(self.num_tokens)
        return out

    def _output(self) -> GenerationOutput:
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            generated_tokens=list(self.generated),
            logprobs=list(self.logprobs) if self.return_logprobs else None,
            status=self.status,
            finish_reason=self.finish_reason if self.status.is_final else None,
            error=self.error,
            policy_version=self.policy_version,
            num_cached_tokens=self.num_cached_tokens,
            versions=list(self.versions),
        )
