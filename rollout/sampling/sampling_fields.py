"""What a request may ask of the sampler: every `GenerationConfig` field classified, the per-request
sampling fields bound to a model (`bind`): one `SamplingParams` (`rollout.sampling_params`), as the sampler reads it.

`GENERATION_FIELDS` is the one table of transformers' `GenerationConfig` fields: each is "applied" (a
logits processor or stop rule of the engine), "refused" (it changes the output in a way the engine does
not implement: a ValueError naming it at submission when it is set to anything but its neutral value)
or "no effect" (it cannot change the tokens or logprobs of one sampled sequence). A field missing from
the table is refused when set, so a new transformers field is never ignored silently.

The per-request fields are `SamplingParams`' (`rollout.sampling_params.FIELDS`: vLLM's names where vLLM has
the field); `generation_defaults` maps a generation config onto them. Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from rollout.sampling_params import ALIASES, PROCESSOR_FIELDS, SamplingParams

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
    "prompt_lookup_num_tokens": (APPLIED, "lossless n-gram speculation: draft tokens per step "
                                          "(rollout.engine.speculation)"),
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


# NOTE: the GenerationConfig fields that are SamplingParams processor fields (transformers' spellings)
GENERATION_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "no_repeat_ngram_size",
                       "min_new_tokens", "min_length", "sequence_bias", "bad_words_ids", "suppress_tokens",
                       "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                       "prompt_lookup_num_tokens", "max_matching_ngram_size")


def generation_defaults(gc: Any, eos_ids: Iterable[int]) -> dict[str, Any]:
    """The `SamplingParams` fields a `GenerationConfig` asks for, by their `SamplingParams` names (a ValueError
    naming the first field that changes the output in a way the engine does not implement)."""
    d = gc.to_dict() if hasattr(gc, "to_dict") else dict(vars(gc))
    for name, value in sorted(d.items()):
        if name.startswith("_") or value is None:
            continue
        kind = GENERATION_FIELDS.get(name, (REFUSED, "unknown to the rollout engine"))
        if kind[0] == REFUSED and value not in NEUTRAL.get(name, ()):
            raise ValueError(f"generation_config.{name}={value!r} is not supported by the rollout engine "
                             f"({kind[1]})")
    spec = {ALIASES.get(name, name): d[name] for name in GENERATION_SAMPLING if d.get(name) is not None}
    if not d.get("do_sample"):  # NOTE: warpers only run when sampling
        spec = {k: v for k, v in spec.items() if k not in ("top_k", "top_p", "min_p")}
        spec["temperature"] = 0.0
    if spec.get("bad_words_ids") is not None:  # NOTE: transformers drops bad words equal to [eos]
        eos = set(eos_ids)
        spec["bad_words_ids"] = [w for w in spec["bad_words_ids"] if not (len(w) == 1 and w[0] in eos)]
    return spec


def bind(sampling: SamplingParams, defaults: Mapping[str, Any], vocab: int,
         per_request: bool = True) -> SamplingParams:
    """`sampling` as the sampler reads it: its processor fields over the engine's `defaults` (the generation
    config's; only the defaults when `per_request` is off), token ids checked against `vocab` (ValueError naming
    the field), and bad words / suppressed tokens / logit bias folded into one `logit_bias` (single tokens) and
    `sequence_bias` (longer sequences). Returns the same class; `given` is kept."""
    own = sampling.set_fields()
    processors = {k: v for k, v in own.items() if k in PROCESSOR_FIELDS} if per_request else {}
    spec = {**defaults, **processors}
    merged = SamplingParams.from_fields(spec) if spec else SamplingParams()
    _in_vocab("stop_token_ids", sampling.stop_token_ids, vocab)
    for name in ("suppress_tokens", "begin_suppress_tokens", "forced_eos_token_ids"):
        _in_vocab(name, getattr(merged, name), vocab)
    if merged.forced_bos_token_id is not None:
        _in_vocab("forced_bos_token_id", (merged.forced_bos_token_id,), vocab)
    bias: dict[int, float] = {}
    multi: list[tuple[tuple[int, ...], float]] = []

    def add(ids: tuple[int, ...], b: float) -> None:
        if len(ids) == 1:
            bias[ids[0]] = bias.get(ids[0], 0.0) + b
        else:
            multi.append((ids, b))

    for t, b in merged.logit_bias:
        _in_vocab("logit_bias", (t,), vocab)
        add((t,), b)
    for ids, b in merged.sequence_bias:
        _in_vocab("sequence_bias", ids, vocab)
        add(ids, b)
    for ids in merged.bad_words_ids:
        _in_vocab("bad_words_ids", ids, vocab)
        add(ids, -math.inf)
    for t in sorted(set(merged.suppress_tokens)):
        add((t,), -math.inf)
    concrete = {name: getattr(merged, name) for name in PROCESSOR_FIELDS}
    concrete.update(logit_bias=tuple(sorted(bias.items())), sequence_bias=tuple(multi), bad_words_ids=(),
                    suppress_tokens=(), begin_suppress_tokens=tuple(sorted(set(merged.begin_suppress_tokens))))
    return sampling.bound(**concrete)


def _in_vocab(name: str, ids: Iterable[int], vocab: int) -> None:
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"{name} must hold token ids in [0, {vocab}), got {list(ids)!r}")
