"""vLLM's token-in / token-out routes, in vLLM 0.32's request and response shapes (`vllm serve --enable-scale-out`):

- `POST /inference/v1/generate` `{request_id?, model?, token_ids, sampling_params{...}, stream?, cache_salt?,
  priority?, return_token_ids?, output_mode?: "tokens"|"text", return_routed_experts?}` -> `{request_id:
  "generate-tokens-<id>", model, created, usage, prompt_logprobs, prompt_token_ids, output_mode, choices[{index,
  finish_reason, stop_reason, token_ids, routed_experts, sampling_mask, weight_versions [{version, start, end}],
  logprobs{content[{token_id, token: "token_id:N", logprob, rank, top_logprobs}]}}]}`. The sampling fields are
  vLLM's `SamplingParams` names (`GenerateSamplingParams`); unknown ones (`output_kind`, `skip_clone`, ...) are
  ignored, as vLLM's own request model does. Logprob entries carry both `token_id` (vLLM) and
  `token: "token_id:N"` (what verifiers' `TrainClient` requires); `top_logprobs` holds the sampled token first,
  then the most likely others, `max(logprobs, 1)` entries, as vLLM 0.32 sends them. Streamed, each event carries
  the new tokens; the last one the finish reason and the whole sequence's `weight_versions` spans.
- `POST /inference/v1/abort_requests {request_ids}`: cancels those requests (their choices end with "abort").

Requests go to the engine through `EngineBridge.sampling`, the one place a wire request becomes the engine's
sampling fields. Weight-version names (`version` of a span) are `rollout.serve.vllm_control.version_name`'s.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.serve.bridge import EngineBridge
from rollout.serve.logprobs import FLOOR, prompt_logprobs
from rollout.serve.lora_routes import lora_of
from rollout.serve.openai_routes import failed_event
from rollout.serve.protocol import MAX_LOGPROBS, APIError, SamplingRequest, TokenIds
from rollout.serve.text import SampleText
from rollout.serve.vllm_control import abort, registry, version_spans

router = APIRouter()
TopK = Annotated[int, Field(ge=0, le=MAX_LOGPROBS, strict=True)]


class GenerateSamplingParams(SamplingRequest):
    """`sampling_params` of `/inference/v1/generate`: vLLM's `SamplingParams` names (the OpenAI routes' checks)."""

    logprobs: TopK | None = None  # the sampled token's logprob, rank and max(logprobs, 1) top entries
    prompt_logprobs: TopK | None = None
    return_sampling_mask: bool = False

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        # NOTE: at least 1 with logprobs: the engine ranks the sampled token where it records a top k
        asked = [k for k in (self.logprobs, self.prompt_logprobs) if k is not None]
        return max([max(k, 1) for k in asked], default=0)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_id: str | None = None
    model: str | None = None
    token_ids: TokenIds
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: Annotated[int, Field(strict=True)] = 0
    return_token_ids: bool | None = None
    return_routed_experts: bool = False
    output_mode: Literal["tokens", "text"] = "tokens"
    features: Any = None  # NOTE: multimodal inputs: refused (a text model)

    @model_validator(mode="after")
    def _inputs(self) -> GenerateRequest:
        if self.features is not None:
            raise APIError("features (multimodal inputs) are not supported by the rollout engine", "features")
        return self

    def sampling(self) -> GenerateSamplingParams:
        """The sampling params with the request-level fields `EngineBridge.sampling` reads."""
        return self.sampling_params.model_copy(update={
            "stream": self.stream, "return_routed_experts": self.return_routed_experts,
            "return_token_ids": True})


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_ids: list[str] = Field(default_factory=list)


@router.post("/inference/v1/generate")
async def generate(req: GenerateRequest, request: Request):
    state = request.app.state
    bridge: EngineBridge = state.bridge
    lora = lora_of(req.model, state)
    sp = req.sampling()
    ids = list(req.token_ids)
    bridge.check_ids(ids, "token_ids")
    budget = bridge.budget(len(ids), sp.max_tokens, "token_ids")
    samples, plan = [], []
    for j in range(sp.n):
        samples.append(SampleText(j, ids, state.tokenizer, sp.stop_strings, sp.skip_special_tokens))
        plan.append((ids, bridge.sampling(sp, budget, 0, j)))
    queue: asyncio.Queue = asyncio.Queue()
    rids = bridge.submit(plan, True, queue, lora, cache_salt=req.cache_salt)
    by_rid = dict(zip(rids, samples, strict=True))
    client_id = req.request_id or uuid.uuid4().hex
    rid = f"generate-tokens-{client_id}"
    table = registry(state)
    table[client_id] = table[rid] = rids
    bridge.counters["requests"] += 1
    reply = Reply(req, sp, state, rid, lora or state.served_model_name, ids)
    if req.stream:
        return StreamingResponse(_stream(bridge, reply, by_rid, queue, table, (client_id, rid)),
                                 media_type="text/event-stream")
    try:
        if not await bridge.collect(queue, by_rid, plan[0][1].routes, request.is_disconnected):
            return JSONResponse({}, status_code=499)
    finally:
        table.pop(client_id, None)
        table.pop(rid, None)
    return JSONResponse(reply.body(samples))


@router.post("/inference/v1/abort_requests")
async def abort_requests(req: AbortRequest, request: Request) -> Response:
    abort(request.app.state, req.request_ids)
    return Response(status_code=200)


class Reply:
    """The response body (or streamed events) of one generate request."""

    def __init__(self, req: GenerateRequest, sp: GenerateSamplingParams, state, rid: str, model: str,
                 prompt: list[int]) -> None:
        self.req, self.sp, self.state, self.rid, self.model, self.prompt = req, sp, state, rid, model, prompt
        self.text = req.output_mode == "text"
        self.created = int(time.time())

    def choice(self, s: SampleText, start: int, end: int, final: bool) -> dict:
        """Choice `s` with its tokens [start, end); `final`: the finish reason, spans, mask and routes too."""
        tokens = s.tokens[start:end]
        body: dict = {"index": s.index, "finish_reason": s.finish_reason if final else None,
                      "stop_reason": self.stop_reason(s) if final else None, "token_ids": tokens,
                      "routed_experts": self.routes(s) if final else None,
                      "sampling_mask": self.mask(s, start, end), "weight_versions": None}
        if final:
            body["weight_versions"] = version_spans(self.state, s.versions[: len(s.tokens)])
        if self.text:
            body["text"] = s.text
        body["logprobs"] = self.logprobs(s, start, end)
        return body

    def stop_reason(self, s: SampleText) -> int | str | None:
        """vLLM's: the stop token id (not an EOS) or stop string that ended the sample, else None."""
        if s.finish_reason != "stop":
            return None
        if s.tokens and s.tokens[-1] in (self.sp.stop_token_ids or ()):
            return s.tokens[-1]
        text = s.tokenizer.decode(s.tokens, skip_special_tokens=s.skip) if s.tokenizer is not None else ""
        return next((t for t in self.sp.stop_strings if t in text), None)

    def mask(self, s: SampleText, start: int, end: int) -> list[list[int]] | None:
        if not self.sp.return_sampling_mask:
            return None
        masks = s.masks or []
        return masks[start:end]

    def routes(self, s: SampleText) -> dict | None:
        """verifiers' shape: `{data: base64 of uint8 [T, L, k], shape, start}`, one row per token but the last."""
        routes = s.routes()
        if routes is None:
            return None
        arr = routes.to("cpu").numpy()
        if arr.min(initial=0) < 0 or arr.max(initial=0) > 255:
            raise APIError("routed_experts: expert ids outside [0, 255] cannot go in this route's uint8 encoding",
                           "return_routed_experts", 500, "server_error")
        return {"data": base64.b64encode(arr.astype("uint8").tobytes()).decode("ascii"),
                "shape": list(arr.shape), "start": 0}

    def logprobs(self, s: SampleText, start: int, end: int) -> dict | None:
        k = self.sp.logprobs
        if k is None or s.logprobs is None:
            return None
        content = []
        for pos in range(start, end):
            tok, lp = s.tokens[pos], max(s.logprobs[pos], FLOOR)
            vals, ids, rank = s.top[0][pos], s.top[1][pos], s.ranks[pos]
            entries = [(tok, lp, rank)] + [(i, max(v, FLOOR), r + 1)
                                           for r, (i, v) in enumerate(zip(ids, vals, strict=True)) if i != tok]
            tops = [self.entry(s, *e) for e in entries[: max(k, 1)]]
            content.append({**self.entry(s, tok, lp, rank), "top_logprobs": tops})
        return {"content": content}

    def entry(self, s: SampleText, tok: int, lp: float, rank: int) -> dict:
        if self.text:
            text = s.token_strings([tok])[0]
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        return {"token_id": tok, "token": f"token_id:{tok}", "logprob": lp, "rank": rank}

    def usage(self, samples: list[SampleText]) -> dict:
        done = sum(len(s.tokens) for s in samples)
        return {"prompt_tokens": len(self.prompt), "total_tokens": len(self.prompt) + done,
                "completion_tokens": done, "prompt_tokens_details": None, "completion_tokens_details": None}

    def body(self, samples: list[SampleText]) -> dict:
        plps = prompt_logprobs(self.sp, samples[0]) if samples else None
        return {"request_id": self.rid, "model": self.model, "created": self.created, "usage": self.usage(samples),
                "prompt_logprobs": plps, "prompt_token_id_logprobs": None,
                "prompt_token_ids": self.prompt if self.req.return_token_ids else None, "mm_placeholders": None,
                "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
                "output_mode": self.req.output_mode,
                "choices": [self.choice(s, 0, len(s.tokens), True) for s in samples]}

    def event(self, choice: dict, first: bool) -> str:
        body: dict = {"request_id": self.rid, "usage": None}
        if first and self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt
        body.update(output_mode=self.req.output_mode, choices=[choice])
        return "data: " + json.dumps(body) + "\n\n"


async def _stream(bridge: EngineBridge, reply: Reply, by_rid: dict[str, SampleText], queue: asyncio.Queue,
                  table: dict, keys: tuple[str, str]):
    first = True
    try:
        async for s, _ in bridge.updates(queue, by_rid):
            if s.finish_reason == "error":
                yield failed_event(s)
                continue
            start = s.sent_tokens
            s.new_tokens()
            if s.sent_tokens == start and not s.done:
                continue
            yield reply.event(reply.choice(s, start, s.sent_tokens, s.done), first)
            first = False
        yield "data: [DONE]\n\n"
    finally:  # NOTE: also on disconnect: free the engine's pages
        bridge.cancel([r for r, s in by_rid.items() if not s.done])
        for key in keys:
            table.pop(key, None)
