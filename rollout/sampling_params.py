"""`SamplingParams`: the one public sampling object, carried whole from every entry point to the sampler.

    from rollout import SamplingParams
    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=256, logprobs=5, stop_token_ids=[2])
    batch = engine.generate(prompts, sampling=sp, group_size=8)     # or one SamplingParams per prompt

Field names are vLLM's where vLLM has the field (`max_tokens`, `min_tokens`, `logprobs`, `stop_token_ids`,
`ignore_eos`, `logit_bias`, `bad_words_ids`, penalties), transformers' `GenerationConfig` names for the
processors only transformers has (`no_repeat_ngram_size`, `sequence_bias`, `suppress_tokens`, ...). A field left
unset (None) takes the engine's default (its generation config's value, else the neutral value); `given` names
the fields that were set, so the engine layers them over its defaults and a keyword of `generate` that names
the same field is refused. Each field is checked once, here, with a ValueError naming it; token ids are checked
against the vocabulary where the object meets a model (`rollout.sampling.sampling_fields.bind`), which returns
the same class with every default filled in: what the sampler reads. `FIELDS` is the one list of the fields:
the servers' request models, docs/sampling.md's table and the sampler follow it. Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

# NOTE: (neutral value, what it does): the one table of the public fields; `None` neutral = stays None
FIELDS: dict[str, tuple[Any, str]] = {
    "temperature": (1.0, "softmax temperature; 0 = greedy"),
    "top_p": (1.0, "nucleus sampling: smallest set of tokens with probability >= top_p (1 = off)"),
    "top_k": (0, "sample among the k most likely tokens (0 = off)"),
    "min_p": (0.0, "drop tokens below min_p x the top token's probability (0 = off)"),
    "seed": (None, "the call's seed: group i, sample j draws from stream sample_seed(group_seed(seed, i), j)"),
    "max_tokens": (None, "most tokens to generate (None: the generation config's max_new_tokens)"),
    "min_tokens": (0, "stop tokens masked until this many tokens are generated"),
    "stop_token_ids": ((), "token ids that end the completion, besides the model's EOS ids"),
    "ignore_eos": (False, "do not stop at the model's EOS ids"),
    "logprobs": (0, "the top-k alternatives (<= 20) returned beside each sampled token's logprob"),
    "prompt_logprobs": (None, "score the prompt's tokens too (servers, `score`), with this many alternatives"),
    "repetition_penalty": (1.0, "transformers' penalty over prompt + generated tokens (1 = off)"),
    "presence_penalty": (0.0, "vLLM's penalty for tokens already generated"),
    "frequency_penalty": (0.0, "vLLM's penalty per occurrence of a generated token"),
    "logit_bias": ((), "token id -> bias added to its logit (a dict, or (id, bias) pairs)"),
    "bad_words_ids": ((), "token-id sequences never generated"),
    "return_sampling_mask": (False, "return, per generated token, the ids the sampler could draw"),
    "no_repeat_ngram_size": (0, "transformers: ban repeating n-grams of this size"),
    "min_length": (0, "transformers: stop tokens masked while prompt + generated < min_length"),
    "sequence_bias": ((), "transformers: ((ids...), bias) pairs"),
    "suppress_tokens": ((), "transformers: tokens never generated"),
    "begin_suppress_tokens": ((), "transformers: tokens not generated first"),
    "forced_bos_token_id": (None, "transformers: forced after a one-token prompt"),
    "forced_eos_token_ids": ((), "transformers: forced at the last token of the budget"),
    "prompt_lookup_num_tokens": (0, "lossless n-gram speculation: draft tokens per step (0: the engine's)"),
    "max_matching_ngram_size": (0, "the longest n-gram those drafts match (0: the default)"),
}
# NOTE: other spellings accepted by `from_fields` (the wires, transformers' GenerationConfig)
ALIASES = {
    "min_new_tokens": "min_tokens",
    "max_new_tokens": "max_tokens",
    "forced_eos_token_id": "forced_eos_token_ids",
    "top_logprobs": "logprobs",
}
# NOTE: fields that change what the sampler draws (the rest say how long, when to stop, what to return)
PROCESSOR_FIELDS = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "logit_bias", "bad_words_ids", "no_repeat_ngram_size", "min_length",
                    "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
                    "forced_eos_token_ids", "prompt_lookup_num_tokens", "max_matching_ngram_size")
MAX_LOGPROBS = 20


def _number(name: str, value: Any, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return float(value)


def _count(name: str, value: Any, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (high is not None and value > high):
        bound = f" and <= {high}" if high is not None else ""
        raise ValueError(f"{name} must be an int >= 0{bound}, got {value!r}")
    return value


def _id(name: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():  # NOTE: JSON object keys (vLLM's logit_bias)
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {value!r}")
    return value


def _ids(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}")
    return tuple(_id(name, t) for t in value)


def _sequences(name: str, value: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of token-id lists, got {value!r}")
    out = []
    for s in value:
        if isinstance(s, int) or not s:
            raise ValueError(f"{name} must be a list of non-empty token-id lists, got {value!r}")
        out.append(_ids(name, s))
    return tuple(out)


def _bias_pairs(name: str, value: Any, key) -> tuple:
    """{key: bias} or [(key, bias), ...] as a tuple of pairs; biases are numbers (-inf allowed: a ban)."""
    pairs = value.items() if isinstance(value, Mapping) else value
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise ValueError(f"{name} must map token ids to biases, got {value!r}")
    out = []
    try:
        for k, b in pairs:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b) or b == math.inf:
                raise ValueError(f"{name} must map token ids to numbers, got {value!r}")
            out.append((key(name, k), float(b)))
    except (TypeError, ValueError) as e:
        raise ValueError(str(e) if str(e).startswith(name) else f"{name} must map token ids to biases, got "
                         f"{value!r}") from None
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one prompt's completions. Every field defaults to None: "the engine's default" (its
    generation config's value, else the neutral one in `FIELDS`); after construction each holds a concrete
    value and `given` names those that were set. See the module docstring and docs/sampling.md."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    bad_words_ids: Sequence[Sequence[int]] | None = None
    return_sampling_mask: bool | None = None
    no_repeat_ngram_size: int | None = None
    min_length: int | None = None
    sequence_bias: Any = None
    suppress_tokens: Sequence[int] | None = None
    begin_suppress_tokens: Sequence[int] | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_ids: Sequence[int] | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    given: frozenset = field(init=False, default=frozenset(), repr=False, compare=False)
    # NOTE: computed once (the sampler asks every row every step): whether any logits processor is on
    uses_processors: bool = field(init=False, default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = frozenset(f for f in FIELDS if getattr(self, f) is not None)
        for name in FIELDS:
            value = getattr(self, name)
            object.__setattr__(self, name, FIELDS[name][0] if value is None else _check(name, value))
        object.__setattr__(self, "given", given)
        on = (self.penalised or bool(self.logit_bias) or bool(self.sequence_bias) or self.no_repeat_ngram_size > 0
              or self.min_tokens > 0 or self.min_length > 0 or bool(self.begin_suppress_tokens)
              or bool(self.bad_words_ids) or bool(self.suppress_tokens)
              or self.forced_bos_token_id is not None or bool(self.forced_eos_token_ids))
        object.__setattr__(self, "uses_processors", on)

    @classmethod
    def from_fields(cls, fields_: Mapping[str, Any]) -> SamplingParams:
        """From a dict of field names (aliases such as `min_new_tokens`, `max_new_tokens` accepted; None values
        skipped); an unknown name is a ValueError naming it."""
        kwargs: dict[str, Any] = {}
        for name, value in fields_.items():
            key = ALIASES.get(name, name)
            if key not in FIELDS:
                raise ValueError(f"unknown sampling field {name!r}; valid: {sorted([*FIELDS, *ALIASES])}")
            if value is not None:
                kwargs[key] = value
        return cls(**kwargs)

    def set_fields(self) -> dict[str, Any]:
        """The fields that were set, by name (what overrides the engine's defaults)."""
        return {name: getattr(self, name) for name in FIELDS if name in self.given}

    def with_fields(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` set on top of this object's set fields (None values leave a field unset)."""
        return SamplingParams(**{**self.set_fields(), **{k: v for k, v in changes.items() if v is not None}})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether it needs the device-side token counts (repetition / presence / frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def bound(self, **concrete: Any) -> SamplingParams:
        """The same fields with `concrete` ones replaced, `given` kept (`sampling_fields.bind`'s result)."""
        out = replace(self, **concrete)
        object.__setattr__(out, "given", self.given)
        return out


def _check(name: str, value: Any) -> Any:
    """One field's value, checked (ValueError naming it) and normalised (lists to tuples)."""
    if name == "temperature":
        return check_temperature(value)
    if name == "top_p":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 < value <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {value!r}")
        return float(value)
    if name == "top_k":  # NOTE: the wires map vLLM's / SGLang's -1 ("off") to 0 before they build one
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {value!r}")
        return value
    if name == "min_p":
        return _number("min_p", value, 0.0, 1.0)
    if name == "seed":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"seed must be an int, got {value!r}")
        return value
    if name == "max_tokens":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"max_tokens must be a positive int, got {value!r}")
        return value
    if name in ("min_tokens", "no_repeat_ngram_size", "min_length", "prompt_lookup_num_tokens",
                "max_matching_ngram_size"):
        return _count(name, value)
    if name in ("logprobs", "prompt_logprobs"):
        return _count(name, value, MAX_LOGPROBS)
    if name in ("ignore_eos", "return_sampling_mask"):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if name == "repetition_penalty":
        return _number(name, value, 0.0, low_open=True)
    if name in ("presence_penalty", "frequency_penalty"):
        return _number(name, value)
    if name in ("stop_token_ids", "suppress_tokens", "begin_suppress_tokens", "forced_eos_token_ids"):
        return _ids(name, value)
    if name == "forced_bos_token_id":
        ids = _ids(name, value)
        if len(ids) != 1:
            raise ValueError(f"forced_bos_token_id must be one token id, got {value!r}")
        return ids[0]
    if name == "logit_bias":
        return _bias_pairs(name, value, _id)
    if name == "bad_words_ids":
        return _sequences(name, value)
    if name == "sequence_bias":
        pairs = _bias_pairs(name, value, _ids)
        if any(not ids for ids, _ in pairs):
            raise ValueError(f"sequence_bias holds an empty sequence: {value!r}")
        return pairs
    raise AssertionError(name)


# NOTE: the keywords of `generate` / `score` that name a `SamplingParams` field (keyword -> field)
KEYWORDS = {"temps": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed", "max_new_tokens": "max_tokens"}


def per_prompt(sampling: SamplingParams | Sequence[SamplingParams] | None, count: int,
               **keywords: Any) -> list[SamplingParams]:
    """The `SamplingParams` of each of `count` prompts from a call's `sampling` (one for all, or one per prompt)
    and its keywords (`temps` one value or one per prompt; `top_k`, `top_p`, `seed`, `max_new_tokens` one value):
    a ValueError when a keyword and `sampling` both set one field, or a list has the wrong length."""
    if sampling is None:
        each: list[SamplingParams] = [SamplingParams()] * count
    elif isinstance(sampling, SamplingParams):
        each = [sampling] * count
    elif isinstance(sampling, Sequence) and all(isinstance(s, SamplingParams) for s in sampling):
        if len(sampling) != count:
            raise ValueError(f"sampling has {len(sampling)} SamplingParams for {count} prompts")
        each = list(sampling)
    else:
        raise ValueError(f"sampling must be a SamplingParams or one per prompt, got {type(sampling).__name__}")
    set_keywords = {k: v for k, v in keywords.items() if v is not None}
    for key in set_keywords:
        target = KEYWORDS[key]
        if any(target in s.given for s in each):
            raise ValueError(f"{key}= and sampling.{target} both given: pass one")
    temps = set_keywords.pop("temps", None)
    if temps is not None:
        temps = temperatures(temps, count)
    common = {KEYWORDS[k]: v for k, v in set_keywords.items()}
    if not common and temps is None:
        return each
    return [s.with_fields(**common, **({} if temps is None else {"temperature": temps[i]}))
            for i, s in enumerate(each)]


def temperatures(temps: Any, count: int, field_name: str = "temps") -> list[float]:
    """`temps` (one temperature for all `count` prompts or rows, or one each) as `count` checked floats; the
    check of every call that takes `temps`, before anything is submitted or sent."""
    if isinstance(temps, (int, float)) and not isinstance(temps, bool):
        temps = [temps] * count
    elif isinstance(temps, (str, bytes)) or not isinstance(temps, Iterable):
        raise ValueError(f"{field_name} must be a non-negative number or one for each prompt, got {temps!r}")
    try:
        values = [float(t) for t in temps]
    except (TypeError, ValueError):
        raise ValueError(f"{field_name} must be a non-negative number or one for each prompt, got {temps!r}") from None
    if len(values) != count:
        raise ValueError(f"{field_name} has {len(values)} values; one, or one for each of the {count} prompts or rows")
    return [check_temperature(t, field_name) for t in values]



def check_temperature(value: Any, field_name: str = "temperature") -> float:
    """The one rule for a temperature: a finite number >= 0 (0 = greedy); else a ValueError naming `field_name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{field_name} must be a non-negative number (0 = greedy), got {value!r}")
    return float(value)


def sets_temperature(sampling: SamplingParams | Sequence[SamplingParams] | None) -> bool:
    """Whether `sampling` (one or one per row) sets a temperature (then `score` takes no default `temps`)."""
    items = [] if sampling is None else [sampling] if isinstance(sampling, SamplingParams) else list(sampling)
    return any("temperature" in s.given for s in items)
