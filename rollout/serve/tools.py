"""Tool calls in chat completions: parsing the model's text into OpenAI `tool_calls` (vLLM's parser names).

`rollout serve --tool-call-parser hermes` turns `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks (the format of Hermes, Qwen 2.5 / Qwen 3 and the chat templates we test) into `message.tool_calls`
with `finish_reason: "tool_calls"`; streamed, the text before the first block is sent as content deltas
and the calls arrive in one final delta. Text that does not parse is returned as content, never an
error. `tool_choice`: "auto" (the default with a parser) parses, "none" does not; "required" and a named
function (`{"type": "function", "function": {"name": ...}}`) force the call's opening after the generation
prompt (`<tool_call>`, or `<tool_call>{"name": "NAME", "arguments": ` for a named one, with the newline
after the marker when the chat template writes one): the forced text
becomes part of the prompt's token ids and the model writes the rest of the call. This is not guided
decoding: the call's JSON is the model's, and a call that does not parse is returned as content, as with
"auto" (a function name not among `tools` is refused).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout.serve.protocol import APIError

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
START = {"hermes": "<tool_call>"}
TOOL_CALL_PARSERS = tuple(START)


@dataclass
class ParsedTurn:
    content: str | None  # the text outside the calls (None when empty)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape


def parse_tool_calls(parser: str, text: str) -> ParsedTurn:
    """The calls in `text` (all of them, or none when any block is malformed: then it is all content)."""
    calls = []
    for block in HERMES.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return ParsedTurn(text or None)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedTurn(text or None)
        args = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return ParsedTurn(text or None)
    content = HERMES.sub("", text).strip()
    return ParsedTurn(content or None, calls)


def tool_mode(tools: list[dict] | None, tool_choice: str | dict | None, parser: str | None) -> str | None:
    """The parser to run on this request's output (None: return the text as is); APIError on a choice
    rollout cannot honour."""
    if tool_choice is None:
        return parser if tools and parser else None
    if tool_choice == "none":
        return None
    if tool_choice == "auto":
        if parser is None:
            raise APIError('"auto" tool choice needs the server started with --tool-call-parser', "tool_choice")
        if not tools:
            raise APIError('tool_choice "auto" needs tools', "tool_choice")
        return parser
    if tool_choice == "required" or isinstance(tool_choice, dict):
        forced_prefix(tools, tool_choice, parser)  # NOTE: validates the choice
        return parser
    raise APIError(f'tool_choice must be "auto", "none", "required" or a function, got {tool_choice!r}',
                   "tool_choice")


def forced_prefix(tools: list[dict] | None, tool_choice: str | dict | None, parser: str | None,
                  newline: bool = False) -> str:
    """The text forced after the generation prompt for `tool_choice` "required" or a named function ("" for
    the other choices); APIError when the choice cannot be honoured. `newline`: the chat template writes a
    newline after the start marker (Qwen's `<tool_call>\n{...}`), so the forced opening does too."""
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        return ""
    if parser is None:
        raise APIError(f"tool_choice {tool_choice!r} needs the server started with --tool-call-parser", "tool_choice")
    if not tools:
        raise APIError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "required":
        return START[parser]
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError('a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
    names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
    if name not in names:
        raise APIError(f"tool_choice names function {name!r}, which is not among the tools {names}", "tool_choice")
    return START[parser] + ("\n" if newline else "") + "{\"name\": " + json.dumps(name) + ", \"arguments\": "


def tools_start_newline(chat_template: str | dict | None, parser: str) -> bool:
    """Whether the chat template writes the call's start marker followed by a newline."""
    text = json.dumps(chat_template) if isinstance(chat_template, dict) else (chat_template or "")
    return (START[parser] + "\n") in text or (START[parser] + "\\n") in text


class ToolStream:
    """The streamed content of one chat sample while tool calls may follow: text before the first call's
    start marker goes out as it comes (a tail that could begin the marker is held back); the calls go out
    when the sample is done."""

    def __init__(self, parser: str, prefix: str = "") -> None:
        self.parser = parser
        self.start = START[parser]
        self.prefix = prefix  # NOTE: the forced opening of a call (part of the prompt), see `forced_prefix`
        self.sent = 0  # characters of content sent

    def delta(self, text: str, done: bool) -> tuple[str, list[dict[str, Any]] | None]:
        """(content to send now, the tool calls when done and there are any) for the sample's text so far."""
        text = self.prefix + text
        if not done:
            cut = text.find(self.start)
            if cut < 0:
                cut = len(text) - next((k for k in range(len(self.start) - 1, 0, -1)
                                        if text.endswith(self.start[:k])), 0)
            out = text[self.sent:max(cut, self.sent)]
            self.sent = max(cut, self.sent)
            return out, None
        parsed = parse_tool_calls(self.parser, text)
        if not parsed.tool_calls:
            out, self.sent = text[self.sent:], len(text)
            return out, None
        content = parsed.content or ""
        out = content[self.sent:] if content.startswith(text[:self.sent]) else ""
        self.sent = len(text)
        return out, [{"index": i, **call} for i, call in enumerate(parsed.tool_calls)]
