"""`per_prompt`: the sampling keywords of `generate` and `score`, one value for all prompts or one per prompt."""

from __future__ import annotations

# NOTE: how to tell one value for all prompts from one value per prompt: a per-prompt list holds values
# of the field's own kind (a list of dicts for logit_bias, of id lists for stop_token_ids, ...).
LIST_DEPTH = {"logit_bias": None, "bad_words_ids": 2, "stop_token_ids": 1}


def per_prompt(n: int, **fields) -> list[dict]:
    """The processor keywords of each prompt (`make_request`'s names); ValueError naming a field whose
    per-prompt list has the wrong length."""
    out: list[dict] = [{} for _ in range(n)]
    for name, value in fields.items():
        if value is None:
            continue
        key = "eos_token_ids" if name == "stop_token_ids" else name
        levels = LIST_DEPTH.get(name, 0)
        if levels is None:
            each = isinstance(value, (list, tuple))
        else:
            each = isinstance(value, (list, tuple)) and depth(value) == levels + 1
        if each and len(value) != n:
            raise ValueError(f"{name} has {len(value)} values for {n} prompts")
        for i in range(n):
            out[i][key] = value[i] if each else value
    return out


def depth(value) -> int:
    """Nesting depth of lists: 0 for a scalar, 1 for [1, 2], 2 for [[1], [2]]."""
    d = 0
    while isinstance(value, (list, tuple)):
        if not value:
            return d + 1
        value, d = value[0], d + 1
    return d
