"""What a request may ask of the sampler: every `GenerationConfig` field classified, the per-request
sampling fields validated, and both turned into one `SamplingParams`.

`GENERATION_FIELDS` is the one table of transformers' `GenerationConfig` fields: each is "applied" (a
logits processor or stop rule of the engine), "refused" (it changes the output in a way the engine does
not implement: a ValueError naming it at submission when it is set to anything but its neutral value)
or "no effect" (it cannot change the tokens or logprobs of one sampled sequence). A field missing from
the table is refused when set, so a new transformers field is never ignored silently.

Per-request fields (`SAMPLING_FIELDS`) use the names of `GenerationConfig` where it has one, vLLM's
otherwise (`logit_bias`, `presence_penalty`, `frequency_penalty`; `min_tokens` is an alias of
`min_new_tokens`). Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from rollout.requests import SamplingParams

APPLIED, REFUSED, NO_EFFECT = "applied", "refused", "no effect"

# field -> (class, what it does here). Refused fields list their neutral values in `NEUTRAL`.
GENERATION_FIELDS: dict[str, tuple[str, str]] = {
    "do_sample": (APPLIED, "False/None: greedy (argmax after the logits processors, no warpers)"),
    "temperature": (APPLIED, "warper (sampling only)"),
    "top_k": (APPLIED, "warper (sampling only)"),
    "top_p": (APPLIED, "warper (sampling only)"),
    "min_p": (APPLIED, "warper after top-p, as transformers (sampling only)"),
    "repetition_penalty": (APPLIED, "over prompt + generated tokens, device-side presence"),
    "no_repeat_ngram_size": (APPLIED, "over prompt + generated tokens"),
    "sequence_bias": (APPLIED, "length-1 always; longer ones when the history ends with their prefix"),
    "bad_words_ids": (APPLIED, "-inf sequence bias; [eos] entries dropped as in transformers"),
    "suppress_tokens": (APPLIED, "-inf at every step"),
    "begin_suppress_tokens": (APPLIED, "-inf at the first generated token"),
    "min_length": (APPLIED, "stop ids masked while prompt + generated < min_length"),
    "min_new_tokens": (APPLIED, "stop ids masked while generated < min_new_tokens"),
    "forced_bos_token_id": (APPLIED, "forced when the prompt is one token, as in transformers"),
    "forced_eos_token_id": (APPLIED, "forced at the last token of the budget"),
    "max_new_tokens": (APPLIED, "the request's budget"),
    "max_length": (APPLIED, "budget = max_length - prompt length when max_new_tokens is unset"),
    "eos_token_id": (APPLIED, "stop tokens (with the tokenizer's and the request's)"),
    "num_beams": (REFUSED, "beam search"),
    "num_beam_groups": (REFUSED, "group beam search"),
    "diversity_penalty": (REFUSED, "group beam search"),
    "penalty_alpha": (REFUSED, "contrastive search"),
    "dola_layers": (REFUSED, "DoLa decoding"),
    "guidance_scale": (REFUSED, "classifier-free guidance"),
    "num_return_sequences": (REFUSED, "several samples per prompt: use RolloutEngine.generate(group_size=...)"),
    "constraints": (REFUSED, "constrained beam search"),
    "force_words_ids": (REFUSED, "constrained beam search"),
    "watermarking_config": (REFUSED, "watermarking"),
    "typical_p": (REFUSED, "typical sampling"),
    "epsilon_cutoff": (REFUSED, "epsilon sampling"),
    "eta_cutoff": (REFUSED, "eta sampling"),
    "top_h": (REFUSED, "top-H sampling"),
    "encoder_repetition_penalty": (REFUSED, "penalty over the prompt as encoder input"),
    "encoder_no_repeat_ngram_size": (REFUSED, "n-gram ban over the prompt as encoder input"),
    "exponential_decay_length_penalty": (REFUSED, "EOS boost after a start index"),
    "stop_strings": (REFUSED, "stop strings need a tokenizer: pass stop token ids (the server takes `stop`)"),
    "max_time": (REFUSED, "a wall-clock budget makes outputs depend on load"),
    "prompt_lookup_num_tokens": (APPLIED, "lossless n-gram speculation: draft tokens per step (rollout.engine.speculation)"),
    "assistant_early_exit": (REFUSED, "assisted decoding (self-speculation)"),
    "speculation_type": (REFUSED, "assisted decoding"),
    "use_mtp": (REFUSED, "multi-token-prediction decoding"),
    "token_healing": (REFUSED, "token healing rewrites the prompt"),
    "remove_invalid_values": (NO_EFFECT, "replaces NaN/inf logits only: the engine's fp32 logits are finite"),
    "renormalize_logits": (NO_EFFECT, "log-softmax of the processed scores: the same distribution"),
    "length_penalty": (NO_EFFECT, "beam scores only"),
    "early_stopping": (NO_EFFECT, "beam search only"),
    "low_memory": (NO_EFFECT, "beam / contrastive search only"),
    "num_assistant_tokens": (NO_EFFECT, "tunes an assistant model (none runs)"),
    "num_assistant_tokens_schedule": (NO_EFFECT, "tunes an assistant model (none runs)"),
    "assistant_confidence_threshold": (NO_EFFECT, "tunes an assistant model (none runs)"),
    "assistant_lookbehind": (NO_EFFECT, "tunes an assistant model (none runs)"),
    "target_lookbehind": (NO_EFFECT, "tunes an assistant model (none runs)"),
    "max_matching_ngram_size": (APPLIED, "longest n-gram the speculation's drafts match"),
    "assistant_ensemble_weight": (NO_EFFECT, "tunes an assistant model (none runs)"),
    "is_assistant": (NO_EFFECT, "marks a config as an assistant's"),
    "pad_token_id": (NO_EFFECT, "padding of outputs"),
    "bos_token_id": (NO_EFFECT, "not generated"),
    "decoder_start_token_id": (NO_EFFECT, "encoder-decoder models only"),
    "use_cache": (NO_EFFECT, "the paged cache is always used"),
    "cache_implementation": (NO_EFFECT, "the paged cache is always used"),
    "cache_config": (NO_EFFECT, "the paged cache is always used"),
    "max_cache_len": (NO_EFFECT, "the paged cache is always used"),
    "prefill_chunk_size": (NO_EFFECT, "the scheduler chunks prompts itself"),
    "compile_config": (NO_EFFECT, "see ContinuousBatchingConfig.default_compile_level"),
    "disable_compile": (NO_EFFECT, "see ContinuousBatchingConfig.default_compile_level"),
    "continuous_batching_config": (NO_EFFECT, "pass continuous_batching_config= instead"),
    "output_scores": (NO_EFFECT, "output format"),
    "output_logits": (NO_EFFECT, "output format"),
    "output_attentions": (NO_EFFECT, "output format"),
    "output_hidden_states": (NO_EFFECT, "output format"),
    "return_dict_in_generate": (NO_EFFECT, "output format"),
    "transformers_version": (NO_EFFECT, "metadata"),
}
# NOTE: values of a refused field that leave the output as plain decoding makes it
NEUTRAL: dict[str, tuple] = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "diversity_penalty": (None, 0.0),
    "penalty_alpha": (None, 0.0), "guidance_scale": (None, 1.0), "num_return_sequences": (None, 1),
    "constraints": (None, []), "force_words_ids": (None, []), "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "encoder_repetition_penalty": (None, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0), "stop_strings": (None, [], ""), "token_healing": (None, False),
    "use_mtp": (None, False),
}

# the per-request fields and their neutral values
SAMPLING_FIELDS: dict[str, Any] = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0,
    "min_length": 0, "logit_bias": None, "sequence_bias": None, "bad_words_ids": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "prompt_lookup_num_tokens": 0, "max_matching_ngram_size": 0,
}
ALIASES = {"min_tokens": "min_new_tokens"}


def generation_defaults(gc: Any, eos_ids: Iterable[int]) -> dict[str, Any]:
    """The per-request sampling fields a `GenerationConfig` asks for (a ValueError naming the first field
    that changes the output in a way the engine does not implement). Values are checked per request."""
    d = gc.to_dict() if hasattr(gc, "to_dict") else dict(vars(gc))
    for name, value in sorted(d.items()):
        if name.startswith("_") or value is None:
            continue
        kind = GENERATION_FIELDS.get(name, (REFUSED, "unknown to the rollout engine"))
        if kind[0] == REFUSED and value not in NEUTRAL.get(name, ()):
            raise ValueError(f"generation_config.{name}={value!r} is not supported by the rollout engine "
                             f"({kind[1]})")
    spec = dict.fromkeys(SAMPLING_FIELDS)
    for name in SAMPLING_FIELDS:
        if d.get(name) is not None:
            spec[name] = d[name]
    if not d.get("do_sample"):
        spec.update(temperature=0.0, top_k=None, top_p=None, min_p=None)  # NOTE: warpers only run when sampling
    if spec["bad_words_ids"] is not None:  # NOTE: transformers drops bad words equal to [eos]
        eos = set(eos_ids)
        spec["bad_words_ids"] = [w for w in spec["bad_words_ids"] if not (len(w) == 1 and w[0] in eos)]
    return {k: v for k, v in spec.items() if v is not None}


def check_temperature(value: Any, field: str = "temperature") -> float:
    """The one rule for a temperature, the server's too: a finite number >= 0 (0 = greedy); else a ValueError
    naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{field} must be a non-negative number (0 = greedy), got {value!r}")
    return float(value)


def temperatures(temps: Any, count: int, field: str = "temps") -> list[float]:
    """`temps` (one temperature for all `count` prompts or rows, or one each) as `count` checked floats; the
    check of every call that takes `temps` (`RolloutEngine.generate` / `score`, `RolloutPool.generate`,
    `run_episodes`), before anything is submitted or sent."""
    if isinstance(temps, (int, float)) and not isinstance(temps, bool):
        temps = [temps] * count
    elif isinstance(temps, (str, bytes)) or not isinstance(temps, Iterable):
        raise ValueError(f"{field} must be a non-negative number or one for each prompt, got {temps!r}")
    try:
        values = [float(t) for t in temps]
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a non-negative number or one for each prompt, got {temps!r}") from None
    if len(values) != count:
        raise ValueError(f"{field} has {len(values)} values; one, or one for each of the {count} prompts or rows")
    return [check_temperature(t, field) for t in values]


def _number(name: str, value: Any, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _ids(name: str, value: Any, vocab: int) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}")
    ids = tuple(value)
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise ValueError(f"{name} must hold token ids in [0, {vocab}), got {list(ids)!r}")
    return ids


def _sequences(name: str, value: Any, vocab: int) -> list[tuple[int, ...]]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of token-id lists, got {value!r}")
    seqs = [_ids(name, s, vocab) if not isinstance(s, int) else None for s in value]
    if any(s is None or not s for s in seqs):
        raise ValueError(f"{name} must be a list of non-empty token-id lists, got {value!r}")
    return seqs


def _sequence_bias(value: Any, vocab: int) -> list[tuple[tuple[int, ...], float]]:
    """transformers' two spellings: {tuple(ids): bias} or [[ids, bias], ...]."""
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        out = [(_ids("sequence_bias", ids, vocab), _number("sequence_bias", b)) for ids, b in pairs]
    except (TypeError, ValueError) as e:
        raise ValueError(f"sequence_bias must map token-id sequences to finite biases ({e}), got {value!r}") from None
    if any(not ids for ids, _ in out):
        raise ValueError(f"sequence_bias holds an empty sequence: {value!r}")
    return out


def make_sampling(spec: Mapping[str, Any], seed: int | None, vocab: int) -> SamplingParams:
    """Validate the sampling fields (ValueError naming the field) and build the request's `SamplingParams`."""
    for name in spec:
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"unknown sampling field {name!r}; valid: {sorted([*SAMPLING_FIELDS, *ALIASES])}")
    s = {**{k: v for k, v in SAMPLING_FIELDS.items() if v is not None}, **{k: v for k, v in spec.items() if v is not None}}
    check_temperature(s["temperature"])
    top_k = s["top_k"]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    top_p = s["top_p"]
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or math.isnan(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    bias: dict[int, float] = {}
    multi: list[tuple[tuple[int, ...], float]] = []

    def add(ids: tuple[int, ...], b: float) -> None:
        if len(ids) == 1:
            bias[ids[0]] = bias.get(ids[0], 0.0) + b
        else:
            multi.append((ids, b))

    if "logit_bias" in spec and spec["logit_bias"] is not None:
        lb = spec["logit_bias"]
        if not isinstance(lb, Mapping):
            raise ValueError(f"logit_bias must be a dict token id -> bias, got {lb!r}")
        for t, b in lb.items():
            add(_ids("logit_bias", int(t) if isinstance(t, str) and t.strip().isdigit() else t, vocab),
                _number("logit_bias", b))
    if spec.get("sequence_bias") is not None:
        for ids, b in _sequence_bias(spec["sequence_bias"], vocab):
            add(ids, b)
    if spec.get("bad_words_ids") is not None:
        for ids in _sequences("bad_words_ids", spec["bad_words_ids"], vocab):
            add(ids, -math.inf)
    if spec.get("suppress_tokens") is not None:
        for t in set(_ids("suppress_tokens", spec["suppress_tokens"], vocab)):
            add((t,), -math.inf)
    forced_bos = spec.get("forced_bos_token_id")
    if forced_bos is not None:
        forced_bos = _ids("forced_bos_token_id", forced_bos, vocab)
        if len(forced_bos) != 1:
            raise ValueError(f"forced_bos_token_id must be one token id, got {spec['forced_bos_token_id']!r}")
    return SamplingParams(
        temperature=float(s["temperature"]), top_k=top_k, top_p=float(top_p), seed=seed,
        min_p=_number("min_p", s["min_p"], 0.0, 1.0),
        repetition_penalty=_number("repetition_penalty", s["repetition_penalty"], 0.0, low_open=True),
        presence_penalty=_number("presence_penalty", s["presence_penalty"]),
        frequency_penalty=_number("frequency_penalty", s["frequency_penalty"]),
        no_repeat_ngram_size=_count("no_repeat_ngram_size", s["no_repeat_ngram_size"]),
        min_new_tokens=_count("min_new_tokens", s["min_new_tokens"]),
        min_length=_count("min_length", s["min_length"]),
        logit_bias=tuple(sorted(bias.items())),
        sequence_bias=tuple(multi),
        begin_suppress_tokens=tuple(sorted(set(_ids("begin_suppress_tokens", spec["begin_suppress_tokens"], vocab))))
        if spec.get("begin_suppress_tokens") is not None else (),
        forced_bos_token_id=None if forced_bos is None else forced_bos[0],
        forced_eos_token_ids=_ids("forced_eos_token_id", spec["forced_eos_token_id"], vocab)
        if spec.get("forced_eos_token_id") is not None else (),
        prompt_lookup_num_tokens=_count("prompt_lookup_num_tokens", s["prompt_lookup_num_tokens"]),
        max_matching_ngram_size=_count("max_matching_ngram_size", s["max_matching_ngram_size"]),
    )


def overrides(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Per-request fields with aliases resolved (`min_tokens` -> `min_new_tokens`); None values dropped;
    an unknown name is a ValueError naming it."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        key = ALIASES.get(name, name)
        if key not in SAMPLING_FIELDS:
            raise ValueError(f"unknown sampling field {name!r}; valid: {sorted([*SAMPLING_FIELDS, *ALIASES])}")
        if value is not None:
            out[key] = value
    return out
