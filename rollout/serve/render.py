"""vLLM 0.32's derender routes: a `/inference/v1/generate` response back into an OpenAI response (the render
routes, which go the other way, are in `rollout.serve.vllm_routes`).

- `POST /v1/chat/completions/derender {generate_response, prompt_token_ids?, prompt_tokens?, chat_request}` -> a
  `chat.completion`: each choice's tokens decoded into an assistant message (tool calls parsed when the request
  has tools and the server a `--tool-call-parser`), `logprobs.content` in the chat shape when `chat_request` asked
  for logprobs, `usage` from the generate response.
- `POST /v1/completions/derender {generate_response, completion_request?}` -> a `text_completion`.

Bad input (no choices, token ids outside the vocabulary) is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from rollout.serve.logprobs import FLOOR
from rollout.serve.protocol import APIError
from rollout.serve.tools import parse_tool_calls, tool_mode

router = APIRouter()


class DerenderRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    generate_response: dict[str, Any]
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = None
    chat_request: dict[str, Any] | None = None
    completion_request: dict[str, Any] | None = None


def _choices(state, gen: dict) -> list[dict]:
    choices = gen.get("choices")
    if not isinstance(choices, list) or not choices:
        raise APIError("generate_response needs a non-empty 'choices' list", "generate_response")
    for c in choices:
        ids = c.get("token_ids") if isinstance(c, dict) else None
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise APIError("generate_response: each choice needs 'token_ids', a list of ints", "generate_response")
        state.bridge.check_ids(ids, "generate_response")
    return choices


def _text_logprobs(tok, choice: dict) -> dict | None:
    """A generate choice's `logprobs.content` (token ids) in the chat shape (token strings and bytes)."""
    lp = choice.get("logprobs")
    if not lp or not isinstance(lp.get("content"), list):
        return None

    def entry(e: dict) -> dict:
        text = tok.decode([int(e["token_id"])], skip_special_tokens=False)
        return {"token": text, "logprob": max(float(e["logprob"]), FLOOR), "bytes": list(text.encode())}

    try:
        return {"content": [{**entry(e), "top_logprobs": [entry(t) for t in e.get("top_logprobs") or []]}
                            for e in lp["content"]]}
    except (KeyError, TypeError, ValueError) as err:
        raise APIError(f"generate_response: malformed logprobs ({type(err).__name__}: {err})",
                       "generate_response") from None


def _derendering(req: DerenderRequest, request: Request, original: dict | None):
    """`(app state, the generate response, the original request or {}, its skip_special_tokens)` of a derender
    call; a 400 when the server has no tokenizer to decode with."""
    state = request.app.state
    if state.tokenizer is None:
        raise APIError("this server has no tokenizer", None)
    original = original or {}
    return state, req.generate_response, original, bool(original.get("skip_special_tokens", True))


@router.post("/v1/chat/completions/derender")
async def derender_chat(req: DerenderRequest, request: Request) -> dict:
    state, gen, chat, skip = _derendering(req, request, req.chat_request)
    parser = tool_mode(chat.get("tools"), chat.get("tool_choice"), state.tool_call_parser)
    choices = []
    for c in _choices(state, gen):
        text = state.tokenizer.decode(c["token_ids"], skip_special_tokens=skip)
        message: dict = {"role": "assistant", "content": text}
        reason = c.get("finish_reason")
        if parser is not None:
            parsed = parse_tool_calls(parser, text)
            message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
            if parsed.tool_calls and reason == "stop":
                reason = "tool_calls"
        choices.append({"index": c.get("index", len(choices)), "message": message,
                        "logprobs": _text_logprobs(state.tokenizer, c) if chat.get("logprobs") else None,
                        "finish_reason": reason, "stop_reason": c.get("stop_reason"),
                        "token_ids": c["token_ids"] if chat.get("return_token_ids") else None})
    return {"id": gen.get("request_id"), "object": "chat.completion", "created": gen.get("created"),
            "model": gen.get("model") or chat.get("model") or state.served_model_name, "choices": choices,
            "usage": gen.get("usage"), "prompt_token_ids": req.prompt_token_ids if chat.get("return_token_ids")
            else None}


@router.post("/v1/completions/derender")
async def derender_completion(req: DerenderRequest, request: Request) -> dict:
    state, gen, _, skip = _derendering(req, request, req.completion_request)
    choices = [{"index": c.get("index", i), "text": state.tokenizer.decode(c["token_ids"], skip_special_tokens=skip),
                "logprobs": None, "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason"),
                "token_ids": c["token_ids"]} for i, c in enumerate(_choices(state, gen))]
    return {"id": gen.get("request_id"), "object": "text_completion", "created": gen.get("created"),
            "model": gen.get("model") or state.served_model_name, "choices": choices, "usage": gen.get("usage")}
