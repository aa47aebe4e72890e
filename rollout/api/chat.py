"""Chat prompts: recognising a conversation, and its token ids through the tokenizer's chat template.

One helper for every place that encodes a conversation (the engine's `apply_chat_template`, the
trainers, the TRL integration, the server's chat route), so they all produce the same ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def is_conversational(prompt: Any) -> bool:
    """A prompt given as chat messages (a non-empty list of mappings with a "role"), as TRL decides it."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]


def chat_template_ids(tokenizer, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                      **template_kwargs) -> list[int]:
    """Token ids of one conversation through `tokenizer`'s chat template, ready for the assistant turn
    (`add_generation_prompt`). `template_kwargs` go to `apply_chat_template` (`tools`, `chat_template`,
    the template's own variables). ValueError when the tokenizer has no chat template."""
    if tokenizer is None or (getattr(tokenizer, "chat_template", None) is None
                             and template_kwargs.get("chat_template") is None):
        raise ValueError("a conversational prompt (or chat_template=True) needs a tokenizer with a chat template")
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **template_kwargs)
    # NOTE: transformers 5 returns a BatchEncoding (a Mapping) by default; older versions a list of ids
    return list(out["input_ids"] if isinstance(out, Mapping) else out)
