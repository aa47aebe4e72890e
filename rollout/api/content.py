"""Chat content given as a list of parts (OpenAI's `[{"type": "text", "text": ...}, ...]`): which form a chat
template wants, and each message's content turned into it, as `vllm serve --chat-template-content-format auto`.

A template either prints `message['content']` as a string ("string") or loops over it as parts ("openai").
`content_format` reads that off the template's Jinja syntax tree: "openai" when some `{% for %}` iterates the
`content` of a message that a loop over `messages` (or a variable set from it) yields. `normalize_messages` then
joins a list's text parts with "\\n" for string templates (the text `vllm serve` renders) or hands the
template the text parts as a list. A part of any other type (an image, audio) is refused with a
`ContentPartError` naming it: the engine serves text models only. String content is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]


class ContentPartError(ValueError):
    """A message's content the engine cannot render (a non-text part, or content of another type); the
    message names the message and part (`messages[0].content[1]`)."""


def content_format(template: str | None) -> ContentFormat:
    """ "openai" when `template` iterates a message's content as parts, else "string" (also for templates Jinja
    cannot parse: they fail on rendering anyway)."""
    return "string" if not template else _detect(template)


def normalize_messages(messages: Sequence[Mapping[str, Any]], template: str | None) -> list[Mapping[str, Any]]:
    """`messages` with every list content in the form `template` wants: text parts joined with "\\n"
    ("string" templates) or `[{"type": "text", "text": ...}]` ("openai" templates). Messages whose content is a
    string or None come back as they are (the same objects). Raises ContentPartError for a non-text part or
    content that is neither a string nor a list."""
    fmt: ContentFormat | None = None
    out: list[Mapping[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if content is None or isinstance(content, str):
            out.append(message)
            continue
        if not isinstance(content, list):
            raise ContentPartError(f"messages[{i}].content must be a string or a list of content parts, "
                                   f"got {type(content).__name__}")
        texts = text_parts(content, f"messages[{i}].content")
        fmt = fmt or content_format(template)
        joined: Any = "\n".join(texts) if fmt == "string" else [{"type": "text", "text": t} for t in texts]
        out.append({**message, "content": joined})
    return out


def text_parts(parts: Iterable[Any], where: str) -> list[str]:
    """The texts of a content-parts list; ContentPartError naming `where[j]` for a part that is not text."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping):
            raise ContentPartError(f"{where}[{j}] must be a content part (an object with a 'type'), "
                                   f"got {type(part).__name__}")
        kind = part.get("type", "text" if "text" in part else None)  # NOTE: vLLM takes a bare {"text": ...}
        if kind != "text":
            raise ContentPartError(f"{where}[{j}] is a {kind!r} part; this server takes text parts only "
                                   "(type 'text')")
        if not isinstance(part.get("text"), str):
            raise ContentPartError(f"{where}[{j}] is a text part without a string 'text'")
        texts.append(part["text"])
    return texts


# ------------------------------------------------------------------------------- template inspection
@lru_cache(maxsize=64)
def _detect(template: str) -> ContentFormat:
    root = _parse(template)
    if root is None:
        return "string"
    from jinja2 import nodes

    lists = _aliases(root, {"messages"}, None)
    loops = list(root.find_all(nodes.For))
    message_vars = {loop.target.name for loop in loops
                    if isinstance(loop.target, nodes.Name) and _reads(loop.iter, lists, None)}
    if not message_vars:
        return "string"
    contents = _aliases(root, set(), None, seed=(message_vars, "content"))
    for loop in loops:
        if _reads(loop.iter, message_vars, "content") or _reads(loop.iter, contents, None):
            return "openai"
    return "string"


def _parse(template: str):
    """The template's syntax tree (None when Jinja cannot parse it), parsed as transformers compiles it."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(template).environment.parse(template)
    except Exception:  # NOTE: a private helper of transformers; fall back on a plain sandbox
        pass
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(template)
    except Exception:
        return None


def _reads(node, names: set[str], key: str | None) -> bool:
    """`node` is one of `names` (or its `key` item, `x['key']` / `x.key`), seen through filters, tests and
    slices (`messages[1:]`, `messages | reverse`, `content is iterable`)."""
    from jinja2 import nodes

    def through(n):
        while n is not None and (isinstance(n, (nodes.Filter, nodes.Test))
                                 or (isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Slice))):
            n = n.node
        return n

    node = through(node)
    if key is not None:
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            node = through(node.node)
        elif isinstance(node, nodes.Getattr) and node.attr == key:
            node = through(node.node)
        else:
            return False
    return isinstance(node, nodes.Name) and node.name in names


def _aliases(root, names: set[str], key: str | None, seed: tuple[set[str], str] | None = None) -> set[str]:
    """`names` and every variable `{% set %}` from one of them (transitively); with `seed` (vars, key), also the
    variables set from `var[key]`."""
    from jinja2 import nodes

    found = set(names)
    assigns = [a for a in root.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    grew = True
    while grew:
        grew = False
        for a in assigns:
            if a.target.name in found:
                continue
            if _reads(a.node, found, key) or (seed is not None and _reads(a.node, seed[0], seed[1])):
                found.add(a.target.name)
                grew = True
    return found
