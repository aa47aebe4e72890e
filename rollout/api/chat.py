"""Chat prompts: recognising a conversation, and its token ids through the tokenizer's chat template.

One helper for every place that encodes a conversation (the engine's `apply_chat_template`, the
trainers, the agents' `ChatBridge`, the TRL integration, the server's chat and tokenize routes), so they all
produce the same ids. Content given as a list of parts is put in the form the template wants first
(`rollout.api.content`: text parts joined with "\\n", or passed as parts to templates that iterate them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.api.content import normalize_messages


def is_conversational(prompt: Any) -> bool:
    """A prompt given as chat messages (a non-empty list of mappings with a "role"), as TRL decides it."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]


def chat_template_ids(tokenizer, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                      **template_kwargs) -> list[int]:
    """Token ids of one conversation through `tokenizer`'s chat template, ready for the assistant turn
    (`add_generation_prompt`). `template_kwargs` go to `apply_chat_template` (`tools`, `chat_template`,
    the template's own variables). ValueError when the tokenizer has no chat template;
    `rollout.api.content.ContentPartError` (a ValueError) for a content part that is not text."""
    out = _apply(tokenizer, messages, add_generation_prompt, True, template_kwargs)
    # NOTE: transformers 5 returns a BatchEncoding (a Mapping) by default; older versions a list of ids
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def chat_template_text(tokenizer, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                       **template_kwargs) -> str:
    """The conversation rendered by the chat template, as text (what `chat_template_ids` tokenizes)."""
    return _apply(tokenizer, messages, add_generation_prompt, False, template_kwargs)


def _apply(tokenizer, messages: Sequence[Mapping], add_generation_prompt: bool, tokenize: bool, kwargs: dict):
    if tokenizer is None or (getattr(tokenizer, "chat_template", None) is None and kwargs.get("chat_template") is None):
        raise ValueError("a conversational prompt (or chat_template=True) needs a tokenizer with a chat template")
    messages = normalize_messages(messages, _template_text(tokenizer, kwargs))
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                         tokenize=tokenize, **kwargs)


def _template_text(tokenizer, kwargs: dict) -> str | None:
    """The Jinja source `apply_chat_template` will render: `chat_template=` (a source, or the name of one of
    the tokenizer's templates) or the tokenizer's own (its "default", or "tool_use" with tools, when named)."""
    given, own = kwargs.get("chat_template"), getattr(tokenizer, "chat_template", None)
    if isinstance(given, str) and ("{{" in given or "{%" in given):
        return given
    if isinstance(own, Mapping):
        name = given or ("tool_use" if kwargs.get("tools") and "tool_use" in own else "default")
        return own.get(name)
    return own if isinstance(own, str) else None
