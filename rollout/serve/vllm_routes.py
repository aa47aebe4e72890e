"""vLLM's auxiliary routes, for clients and routers written against `vllm serve` (vllm-router's cache-aware
policy tokenizes every request on each worker first):

- `POST /tokenize`: `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...], "add_generation_prompt":
  true, "add_special_tokens": false, "tools", "chat_template_kwargs"}` (vLLM's defaults) -> `{"tokens", "count",
  "max_model_len"}` (`"token_strs"` too with `return_token_strs`). Messages give exactly the prompt ids
  `/v1/chat/completions` would (`rollout.api.chat`, content parts included); `add_special_tokens: true` on
  messages tokenizes the rendered text with the tokenizer's specials, as vLLM does.
- `POST /detokenize`: `{"tokens": [ids]}` -> `{"prompt": text}` (special tokens kept, as vLLM).
- `POST /v1/completions/render` (a completions body -> a list, one per prompt) and `POST
  /v1/chat/completions/render` (a chat body -> one) of vLLM's token-in `GenerateRequest`s: `{"request_id",
  "token_ids", "sampling_params", "model", "stream", "stream_options", "token_offsets": null}`, the prompt ids
  the generating route would run; nothing is generated. vllm-router 0.1.17 calls the one matching each request
  on every worker before `/tokenize`.
- `GET /version`: `{"version"}` (rollout's); `GET|POST /ping`: 200 while the engine runs, 503 otherwise (as
  `/health`).

`/version` and `/ping` are open like `/health`; `/tokenize`, `/detokenize` and the render routes are behind the API key
like the `/v1/` routes (`rollout.serve.app`). Bad input is a 400 naming the field.
"""

from __future__ import annotations

import uuid
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout.api.chat import chat_template_ids, chat_template_text
from rollout.api.content import ContentPartError
from rollout.serve.lora_routes import lora_of
from rollout.serve.openai_routes import chat_prompt, encode_prompt
from rollout.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    check_messages,
)

router = APIRouter()


class TokenizeRequest(BaseModel):
    """vLLM's `TokenizeCompletionRequest` and `TokenizeChatRequest` in one model: `prompt` xor `messages`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _roles(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return None if v is None else check_messages(v)  # NOTE: the chat route's own checks

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send either prompt (a string) or messages (a list of chat messages)",
                           "prompt" if self.messages is None else "messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(strict=True)]]


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict:
    state = request.app.state
    _check(req.model, state)
    tok = state.tokenizer
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(tok(req.prompt, add_special_tokens=special)["input_ids"])
    else:
        if not getattr(tok, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template", "messages")
        kwargs = dict(req.chat_template_kwargs or {}, tools=req.tools)
        try:
            if req.add_special_tokens:
                text = chat_template_text(tok, req.messages, req.add_generation_prompt, **kwargs)
                ids = list(tok(text, add_special_tokens=True)["input_ids"])
            else:
                ids = chat_template_ids(tok, req.messages, req.add_generation_prompt, **kwargs)
        except ContentPartError as e:
            raise APIError(str(e), "messages") from None
        except Exception as e:  # NOTE: a template error is the caller's input, as on /v1/chat/completions
            raise APIError(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                           "messages") from None
    body: dict = {"tokens": ids, "count": len(ids), "max_model_len": state.bridge.max_model_len}
    if req.return_token_strs:
        body["token_strs"] = tok.convert_ids_to_tokens(ids)
    return body


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
    state = request.app.state
    _check(req.model, state)
    state.bridge.check_ids(req.tokens, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


# NOTE: the request fields that are vLLM `SamplingParams` fields under the same name
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "max_tokens", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "skip_special_tokens", "logit_bias")


def _generate_request(req: SamplingRequest, ids: list[int], model: str, prefix: str) -> dict:
    params = {k: getattr(req, k) for k in SAMPLING_FIELDS}
    params["logprobs"] = None if req.logprobs is None or req.logprobs is False else req.num_top_logprobs
    return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "token_ids": ids, "sampling_params": params,
            "model": model, "stream": req.stream, "stream_options": req.stream_options, "token_offsets": None}


@router.post("/v1/completions/render")
async def render_completion(req: CompletionRequest, request: Request) -> list[dict]:
    state = request.app.state
    lora_of(req.model, state)  # NOTE: an unknown model is a 400 here as on the generating route
    model = req.model or state.served_model_name
    return [_generate_request(req, encode_prompt(state.tokenizer, p), model, "cmpl") for p in req.prompts()]


@router.post("/v1/chat/completions/render")
async def render_chat(req: ChatCompletionRequest, request: Request) -> dict:
    state = request.app.state
    lora_of(req.model, state)
    ids, _, _ = chat_prompt(state, req)
    return _generate_request(req, ids, req.model or state.served_model_name, "chatcmpl")


@router.get("/version")
async def server_version() -> dict:
    try:
        return {"version": version("rollout")}
    except PackageNotFoundError:  # NOTE: run from a source tree that is not installed
        return {"version": "unknown"}


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    return Response(status_code=200 if request.app.state.bridge.manager.is_running() else 503)


def _check(model: str | None, state) -> None:
    if model is not None and model != state.served_model_name:
        raise APIError(f"model {model!r} does not exist; this server serves {state.served_model_name!r}", "model")
    if state.tokenizer is None:
        raise APIError("this server has no tokenizer", None)
