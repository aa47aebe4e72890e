"""The OpenAI routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (vLLM's extra fields).

One handler per route; each turns the request into samples (prompt-major: choice `i * n + j` is sample
j of prompt i), submits them all, then either collects them or streams them as server-sent events.
A client that disconnects cancels its samples, and the engine frees their pages.

As `vllm serve`: chat `content` may be a list of text parts (`rollout.api.content`: joined with "\n" for
string templates, passed as parts to templates that iterate them; any other part type is a 400 naming it);
`/v1/models` entries carry `max_model_len`, `root` (the model path) and `parent`; streamed responses carry
`usage` on every chunk with `stream_options: {"include_usage": true, "continuous_usage_stats": true}` (that
choice's tokens so far; the usage-only chunk still ends the stream), on the last chunk only with
`include_usage` alone.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout.api.chat import chat_template_ids
from rollout.api.content import ContentPartError
from rollout.api.route_wire import encode_routes
from rollout.serve.bridge import EngineBridge
from rollout.serve.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from rollout.serve.lora_routes import lora_of, model_entries
from rollout.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest
from rollout.serve.text import SampleText
from rollout.serve.tools import ToolStream, forced_prefix, parse_tool_calls, tool_mode, tools_start_newline

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = request.app.state
    entry = {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "rollout",
             "root": state.model_root, "parent": None, "max_model_len": state.bridge.max_model_len}
    return {"object": "list", "data": model_entries(state, entry)}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    state = request.app.state
    lora = lora_of(req.model, state)  # NOTE: `"model": lora_name` runs that adapter (rollout.serve.lora_routes)
    texts = req.prompts()
    prompts = [encode_prompt(state.tokenizer, p) for p in texts]
    return await _serve(request, req, prompts, "prompt", chat=False, texts=texts, lora=lora)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    state = request.app.state
    lora = lora_of(req.model, state)
    ids, parser, prefix = chat_prompt(state, req)
    return await _serve(request, req, [ids], "messages", chat=True, tool_parser=parser, tool_prefix=prefix, lora=lora)


def chat_prompt(state, req: ChatCompletionRequest) -> tuple[list[int], str | None, str]:
    """(prompt ids, tool-call parser or None, forced tool-call prefix) of a chat request."""
    if state.tokenizer is None or not getattr(state.tokenizer, "chat_template", None):
        raise APIError("this model's tokenizer has no chat template", "messages")
    kwargs = dict(req.chat_template_kwargs or {})
    parser = tool_mode(req.tools, req.tool_choice, state.tool_call_parser)
    try:
        ids = chat_template_ids(state.tokenizer, req.messages, add_generation_prompt=req.add_generation_prompt,
                                tools=req.tools, **kwargs)
    except ContentPartError as e:
        raise APIError(str(e), "messages") from None
    except Exception as e:  # NOTE: a template error is the caller's input (bad messages or kwargs)
        raise APIError(f"the chat template failed on these messages: {type(e).__name__}: {e}", "messages") from None
    newline = parser is not None and tools_start_newline(state.tokenizer.chat_template, parser)
    prefix = forced_prefix(req.tools, req.tool_choice, parser, newline)
    if prefix:  # NOTE: "required" / a named function: the call's opening is forced (rollout.serve.tools)
        ids = list(ids) + list(state.tokenizer(prefix, add_special_tokens=False)["input_ids"])
    return list(ids), parser, prefix


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError("this server has no tokenizer: send token ids", "prompt")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return list(prompt)


async def _serve(request: Request, req: SamplingRequest, prompts: list[list[int]], param: str, chat: bool,
                 texts: list | None = None, tool_parser: str | None = None, tool_prefix: str = "",
                 lora: str | None = None):
    state = request.app.state
    bridge: EngineBridge = state.bridge
    samples, plan = [], []
    for i, ids in enumerate(prompts):
        bridge.check_ids(ids, param)
        budget = bridge.budget(len(ids), req.max_tokens, param)
        for j in range(req.n):
            samples.append(SampleText(i * req.n + j, ids, state.tokenizer, req.stop_strings, req.skip_special_tokens))
            samples[-1].ids_as_tokens = getattr(req, "return_tokens_as_token_ids", False)
            if texts is not None and isinstance(texts[i], str):
                samples[-1].prompt_text = texts[i]  # NOTE: echo returns the prompt as sent
            plan.append((ids, bridge.sampling(req, budget, i, j)))
    queue: asyncio.Queue = asyncio.Queue()
    streaming = req.stream or bool(req.stop_strings)
    by_rid = dict(zip(bridge.submit(plan, streaming, queue, lora), samples, strict=True))
    model = lora or state.served_model_name
    bridge.counters["requests"] += 1
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if req.stream:
        events = _stream(bridge, req, by_rid, queue, rid, model, chat, tool_parser, tool_prefix)
        return StreamingResponse(events, media_type="text/event-stream")
    # NOTE: with routes, a sample cut by a stop string waits for its final (cancelled) output, which has them
    if not await bridge.collect(queue, by_rid, bool(plan) and plan[0][1].routes, request.is_disconnected):
        return JSONResponse({}, status_code=499)
    body = _response(req, samples, prompts, rid, model, chat, tool_parser, tool_prefix)
    return JSONResponse(body)


def _usage(samples: list[SampleText], prompts: list[list[int]], n: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(s.tokens) for s in samples)
    cached = sum(max(s.cached_tokens for s in samples[i * n:(i + 1) * n]) for i in range(len(prompts)))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _logprobs(req: SamplingRequest, sample: SampleText, tokens: list[int], lps: list[float] | None, chat: bool,
              start: int = 0):
    if chat:
        return chat_logprobs(req, sample, tokens, lps, start)
    return completion_logprobs(req, sample, tokens, lps, start, echo=getattr(req, "echo", False))


def _response(req, samples: list[SampleText], prompts, rid: str, model: str, chat: bool,
              tool_parser: str | None = None, tool_prefix: str = "") -> dict:
    choices = []
    for s in samples:
        choice: dict = {"index": s.index, "finish_reason": s.finish_reason,
                        "logprobs": _logprobs(req, s, s.tokens, s.logprobs, chat)}
        if chat and tool_parser is not None:
            parsed = parse_tool_calls(tool_parser, tool_prefix + s.text)
            choice["message"] = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
            if parsed.tool_calls and s.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        elif chat:
            choice["message"] = {"role": "assistant", "content": s.text}
        else:
            choice["text"] = _echoed(s) + s.text if req.echo else s.text
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(req, s)
        if req.return_token_ids:
            choice["token_ids"] = list(s.tokens)
            choice["weight_versions"] = s.versions[: len(s.tokens)]
            if not chat:
                choice["prompt_token_ids"] = list(s.prompt_ids)
        if req.return_sampling_mask:  # NOTE: per token, the ids the sampler could draw (`rollout.sampling.sampler`)
            choice["sampling_mask"] = s.masks
        if (routes := s.routes()) is not None:  # NOTE: vLLM's field: [prompt + completion - 1, L, k], base64 .npy
            choice["routed_experts"] = encode_routes(routes)
        choices.append(choice)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(samples, prompts, req.n)}
    if chat and req.return_token_ids:
        body["prompt_token_ids"] = list(prompts[0])
    return body


async def _stream(bridge: EngineBridge, req: SamplingRequest, by_rid: dict[str, SampleText], queue: asyncio.Queue,
                  rid: str, model: str, chat: bool, tool_parser: str | None = None,
                  tool_prefix: str = "") -> AsyncIterator[str]:
    samples = sorted(by_rid.values(), key=lambda s: s.index)
    tool_streams = {s.index: ToolStream(tool_parser, tool_prefix) for s in samples} if chat and tool_parser else {}
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    continuous = req.continuous_usage

    def event(choice: dict, sample: SampleText, **extra) -> str:
        if continuous:  # NOTE: vLLM's per-chunk usage: this choice's prompt and its tokens so far
            done = sample.sent_tokens
            extra["usage"] = {"prompt_tokens": len(sample.prompt_ids), "completion_tokens": done,
                              "total_tokens": len(sample.prompt_ids) + done}
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                      "choices": [choice], **extra}) + "\n\n"

    try:
        if chat:
            for s in samples:
                first = {"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield event(first, s, **({"prompt_token_ids": s.prompt_ids} if req.return_token_ids else {}))
        async for s, delta in bridge.updates(queue, by_rid):
            if s.finish_reason == "error":
                yield failed_event(s)
                continue
            tokens, lps = s.new_tokens()
            if not delta and not tokens and not s.done:
                continue
            choice: dict = {"index": s.index, "finish_reason": s.finish_reason,
                            "logprobs": _logprobs(req, s, tokens, lps, chat, s.sent_tokens - len(tokens))}
            if s.index in tool_streams:
                content, calls = tool_streams[s.index].delta(s.text, s.done)
                choice["delta"] = {"content": content}
                if calls:
                    choice["delta"]["tool_calls"] = calls
                    if s.finish_reason == "stop":
                        choice["finish_reason"] = "tool_calls"
            elif chat:
                choice["delta"] = {"content": delta}
            else:
                choice["text"] = delta
            if req.return_token_ids:
                choice["token_ids"] = tokens
                choice["weight_versions"] = s.versions[s.sent_tokens - len(tokens): s.sent_tokens]
                if not chat and s.sent_tokens == len(tokens):
                    choice["prompt_token_ids"] = s.prompt_ids
            yield event(choice, s)
        if req.include_usage:
            prompts = _prompts_of(samples, req.n)
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                         "usage": _usage(samples, prompts, req.n)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:  # NOTE: also on disconnect (the generator is cancelled / closed): free the engine's pages
        bridge.cancel([r for r, s in by_rid.items() if not s.done])


def failed_event(sample: SampleText) -> str:
    """The stream event of a failed sample, in the OpenAI wire's error shape."""
    return "data: " + json.dumps({"error": {"message": f"generation failed: {sample.error}", "type": "server_error",
                                            "param": None, "code": 500}}) + "\n\n"


def _echoed(sample: SampleText) -> str:
    """The prompt as echoed: the string sent, or the decode of the token ids sent."""
    if sample.prompt_text is not None:
        return sample.prompt_text
    return sample.tokenizer.decode(sample.prompt_ids) if sample.tokenizer is not None else ""


def _prompts_of(samples: list[SampleText], n: int) -> list[list[int]]:
    return [samples[i].prompt_ids for i in range(0, len(samples), n)]
