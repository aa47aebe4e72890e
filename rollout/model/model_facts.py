"""What the engine needs to know about a Hugging Face model, read once from its config and modules.

Attention windows per layer and their grouping, attention sinks, EOS ids, and the parameter version
counters that reveal in-place weight changes. Pure functions; no engine state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def text_config(model: torch.nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


LAYER_TYPES = ("full_attention", "sliding_attention")


def has_attention_sinks(model: torch.nn.Module) -> bool:
    """gpt-oss style learned sinks (a `sinks` tensor on the attention modules)."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())


def layer_windows(model: torch.nn.Module) -> list[int | None]:
    """The attention window of each layer (None = full attention), as the HF attention modules use it.

    `config.layer_types` decides where it exists (Gemma 2, Qwen2/3, gpt-oss: "sliding_attention"
    layers slide, "full_attention" ones do not; any other type, e.g. Llama 4's "chunked_attention", is
    a ValueError); otherwise a set `sliding_window` makes every layer slide (Mistral) unless
    `use_sliding_window` is False. The attention function checks each layer's actual
    `sliding_window` against this plan at run time.
    """
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None) or None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"{type(model).__name__} has {unknown} layers, which rollout's paged attention does not implement "
                f"(it runs {LAYER_TYPES}); treating them as full attention would give wrong outputs"
            )
        return [window if t == "sliding_attention" else None for t in layer_types]
    slides = window is not None and getattr(cfg, "use_sliding_window", True)
    return [window if slides else None] * cfg.num_hidden_layers


def layer_groups(windows: Sequence[int | None]) -> tuple[list[int | None], list[int]]:
    """`(group windows, group of each layer)`: full attention first, then sliding windows by size."""
    groups = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return groups, [groups.index(w) for w in windows]


def eos_ids_of(*sources) -> frozenset[int]:
    """The union of EOS ids of `sources`: ints, lists of ints, None, or objects with `eos_token_id`
    (a tokenizer, a `GenerationConfig`)."""
    out: set[int] = set()
    for src in sources:
        if src is not None and not isinstance(src, (int, list, tuple, set, frozenset)):
            src = getattr(src, "eos_token_id", None)
        if src is None:
            continue
        out.update([src] if isinstance(src, int) else src)
    return frozenset(int(t) for t in out)
