"""SGLang's native API on the same engine, for clients written against an SGLang server (slime / miles through
sglang-router, AReaL's `RemoteSGLangEngine`, verl's SGLang path):

- `POST /generate` `{input_ids | text, sampling_params, rid?, return_logprob?, logprob_start_len?,
  top_logprobs_num?, return_text_in_logprobs?, return_routed_experts?, stream?}` -> `{text, output_ids,
  meta_info{id, finish_reason{type, matched | length | message}, prompt_tokens, completion_tokens,
  cached_tokens, weight_version, e2e_latency, output_token_logprobs [[logprob, id, text|null]], ...}}`; a
  batch (a list of prompts, or `n` > 1) answers a list, prompt-major. Streamed: server-sent events, each the
  whole output so far (SGLang's default, `stream_output` off), then `data: [DONE]`.
- `sampling_params` carries SGLang's names; `sglang_sampling` maps them onto the OpenAI routes' request model
  (vLLM's names), so one validation and one builder (`EngineBridge.sampling`) make the engine's sampling.
- The control and info routes (pause / continue / abort, flush, memory occupation, server and model info) are
  `rollout.serve.sglang_control`'s; `GET /get_weight_version` and `POST /update_weights_from_disk` are
  `rollout.serve.control`'s; the tensor and distributed weight routes are `rollout.serve.sglang_weights`'.

Errors keep the server's shape `{"error": {"message", "type", "param", "code"}}` (SGLang's own `{"error":
{"message"}}` is a subset); bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.serve.bridge import EngineBridge
from rollout.serve.lora_routes import lora_of
from rollout.serve.openai_routes import encode_prompt
from rollout.serve.protocol import MAX_LOGPROBS, APIError, SamplingRequest, validation_error
from rollout.serve.text import SampleText

router = APIRouter()
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's `SamplingParams.max_new_tokens` default
FLOOR = -9999.0  # -inf logprobs (a token outside top-k / top-p) as a finite JSON number, as the OpenAI routes

# SGLang sampling_params name -> the OpenAI routes' (vLLM's) name
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
SAME = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "n",
        "logit_bias", "seed")
# SGLang fields that only shape text or pacing here: accepted, no effect on tokens
IGNORED = ("spaces_between_special_tokens", "stream_interval")
# SGLang fields the engine does not implement: a 400 naming them unless neutral
REFUSED = {"json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "stop_regex": None,
           "custom_params": None, "no_stop_trim": False}


class SglangSampling(SamplingRequest):
    """The OpenAI routes' sampling model plus what `EngineBridge.sampling` asks of a request."""

    logprobs_k: int = 0  # top logprobs per position (SGLang's top_logprobs_num)
    score_prompt: bool = False  # the prompt's own logprobs (logprob_start_len >= 0)

    @property
    def scores_prompt(self) -> bool:
        return self.score_prompt

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs_k


def sglang_sampling(params: dict[str, Any] | None, param: str = "sampling_params", **extra) -> SglangSampling:
    """SGLang's `sampling_params` as the OpenAI routes' sampling model (vLLM's names, checked once there);
    APIError naming the field for an unknown name, a bad value or a feature the engine lacks."""
    params = dict(params or {})
    fields: dict[str, Any] = {}
    for key, value in params.items():
        if key in RENAMED:
            fields[RENAMED[key]] = value
        elif key in SAME:
            fields[key] = value
        elif key in REFUSED:
            if value != REFUSED[key] and value not in (None, {}, ""):
                raise APIError(f"{param}.{key} is not supported by the rollout engine", f"{param}.{key}")
        elif key not in IGNORED:
            raise APIError(f"{param} has an unknown field {key!r}", f"{param}.{key}")
    if fields.get("top_k") is not None and isinstance(fields["top_k"], int) and fields["top_k"] >= 1 << 30:
        fields["top_k"] = -1  # NOTE: SGLang's "off" is 1 << 30 (TOP_K_ALL)
    if fields.get("max_tokens", 1) == 0:
        raise APIError(f"{param}.max_new_tokens must be >= 1", f"{param}.max_new_tokens")
    try:
        return SglangSampling.model_validate({**fields, **extra})
    except ValidationError as e:
        err = validation_error(list(e.errors()))
        sg = {v: k for k, v in RENAMED.items()}.get(err.param, err.param)
        message = err.message.replace(f"{err.param}:", f"{sg}:", 1)
        raise APIError(f"{param}.{message}", f"{param}.{sg}") from None
    except APIError as e:
        raise APIError(f"{param}: {e.message}", f"{param}.{e.param}") from None


class GenerateRequest(BaseModel):
    """SGLang's `GenerateReqInput` (the fields the engine serves; the rest are ignored as SGLang's router
    fills them in with defaults, or refused by name when they ask for something it cannot do)."""

    model_config = ConfigDict(extra="ignore")

    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: (Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]
                | Annotated[list[Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]],
                            Field(min_length=1)] | None) = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | list[int] = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    stream: bool = False
    model: str | None = None
    lora_path: str | None = None  # NOTE: an adapter loaded here, by name (`rollout.serve.lora_routes`)
    # asked-for features the engine lacks: a 400 naming them
    image_data: Any = None
    input_embeds: Any = None
    return_hidden_states: bool = False
    token_ids_logprob: Any = None

    def prompts(self, tokenizer) -> list[list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise APIError("send either text or input_ids", "input_ids" if self.text is not None else "text")
        for name in ("image_data", "input_embeds", "token_ids_logprob"):
            if getattr(self, name) not in (None, [], [None]):
                raise APIError(f"{name} is not supported by the rollout engine", name)
        if self.return_hidden_states:
            raise APIError("return_hidden_states is not supported by the rollout engine",
                           "return_hidden_states")
        if self.input_ids is not None:
            if isinstance(self.input_ids[0], int):
                return [list(self.input_ids)]
            return [list(p) for p in self.input_ids]
        texts = [self.text] if isinstance(self.text, str) else list(self.text)
        try:
            return [encode_prompt(tokenizer, t) for t in texts]
        except APIError as e:
            raise APIError(e.message.replace("send token ids", "send input_ids"), "text") from None

    @property
    def batched(self) -> bool:
        ids = self.input_ids
        return isinstance(self.text, list) or (ids is not None and isinstance(ids[0], list))


def _per_prompt(value, i: int, count: int, name: str):
    """Item `i` of a per-prompt field (a list of `count`), or the one value every prompt shares."""
    if isinstance(value, list):
        if len(value) != count:
            raise APIError(f"{name} has {len(value)} entries for {count} prompts", name)
        return value[i]
    return value


class Sample:
    """One output of a `/generate` call: its text state, sampling and the fields its meta_info needs."""

    def __init__(self, index: int, rid: str, text: SampleText, sp: SglangSampling, max_new_tokens: int,
                 logprob: bool, start: int, top_k: int, with_text: bool) -> None:
        self.index, self.rid, self.text, self.sp = index, rid, text, sp
        self.max_new_tokens, self.logprob, self.start, self.top_k = max_new_tokens, logprob, start, top_k
        self.with_text = with_text  # the token's text in each logprob entry (return_text_in_logprobs)
        self.created = time.monotonic()


def sglang_state(request: Request) -> dict:
    return app_sglang_state(request.app.state)


def app_sglang_state(state) -> dict:
    """The SGLang routes' state on the app; its "labels" are every wire's weight-version names
    (`rollout.serve.vllm_control` reads and writes them too)."""
    if not hasattr(state, "sglang"):
        state.sglang = {"rids": {}, "labels": {}}  # rid -> engine ids; policy_version -> SGLang version label
    return state.sglang


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(req: GenerateRequest, request: Request):
    state = request.app.state
    bridge: EngineBridge = state.bridge
    try:  # NOTE: `model` is ignored as SGLang does (its router sends null); `lora_path` names an adapter
        lora = lora_of(req.lora_path, state)
    except APIError as e:
        raise APIError(e.message, "lora_path") from None
    prompts = req.prompts(state.tokenizer)
    count = len(prompts)
    rids = req.rid if isinstance(req.rid, list) else None
    if rids is not None and len(rids) != count:
        raise APIError(f"rid has {len(rids)} entries for {count} prompts", "rid")
    samples: list[Sample] = []
    plan = []
    for i, ids in enumerate(prompts):
        params = _per_prompt(req.sampling_params, i, count, "sampling_params")
        logprob = bool(_per_prompt(req.return_logprob, i, count, "return_logprob"))
        start = int(_per_prompt(req.logprob_start_len, i, count, "logprob_start_len"))
        top_k = int(_per_prompt(req.top_logprobs_num, i, count, "top_logprobs_num"))
        if not 0 <= top_k <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs_num must be in [0, {MAX_LOGPROBS}]", "top_logprobs_num")
        if logprob and start >= len(ids):
            raise APIError(f"logprob_start_len ({start}) must be < the prompt's {len(ids)} tokens",
                           "logprob_start_len")
        sp = sglang_sampling(params, logprobs_k=top_k if logprob else 0, score_prompt=logprob and start >= 0,
                             stream=req.stream, return_routed_experts=req.return_routed_experts)
        bridge.check_ids(ids, "input_ids")
        max_new = sp.max_tokens
        if max_new is None:  # NOTE: SGLang's default, cut to what the context leaves
            room = None if bridge.max_model_len is None else bridge.max_model_len - len(ids)
            max_new = DEFAULT_MAX_NEW_TOKENS if room is None else max(1, min(DEFAULT_MAX_NEW_TOKENS, room))
        budget = bridge.budget(len(ids), max_new, "input_ids")
        base = rids[i] if rids is not None else (req.rid if isinstance(req.rid, str) and count == 1
                                                else uuid.uuid4().hex)
        for j in range(sp.n):
            rid = base if sp.n == 1 else f"{base}-{j}"
            text = SampleText(len(samples), ids, state.tokenizer, sp.stop_strings, sp.skip_special_tokens)
            samples.append(Sample(len(samples), rid, text, sp, budget, logprob, start, top_k,
                                  req.return_text_in_logprobs))
            plan.append((ids, bridge.sampling(sp, budget, i, j)))
    queue: asyncio.Queue = asyncio.Queue()
    streaming = req.stream or any(s.sp.stop_strings for s in samples)
    engine_ids = bridge.submit(plan, streaming, queue, lora)
    by_id = dict(zip(engine_ids, samples, strict=True))
    table = sglang_state(request)["rids"]
    for eid, s in by_id.items():
        for key in {s.rid, _base(s.rid, s.sp.n)}:  # NOTE: with n > 1, the caller's rid aborts all its samples
            table.setdefault(key, []).append(eid)
    bridge.counters["requests"] += 1
    labels = sglang_state(request)["labels"]
    single = not req.batched and len(samples) == 1
    if req.stream:
        return StreamingResponse(_stream(request, bridge, by_id, queue, labels, single, table),
                                 media_type="text/event-stream")
    texts = {e: s.text for e, s in by_id.items()}
    try:
        if not await bridge.collect(queue, texts, req.return_routed_experts, request.is_disconnected):
            return JSONResponse({}, status_code=499)
    finally:
        _forget(table, by_id)
    bodies = [_output(s, bridge, labels, final=True) for s in samples]
    return JSONResponse(bodies[0] if single else bodies)


def _base(rid: str, n: int) -> str:
    return rid.rsplit("-", 1)[0] if n > 1 else rid


def _forget(table: dict, by_id: dict) -> None:
    for eid, s in by_id.items():
        for key in {s.rid, _base(s.rid, s.sp.n)}:
            ids = table.get(key)
            if ids is not None and eid in ids:
                ids.remove(eid)
                if not ids:
                    del table[key]


async def _stream(request: Request, bridge: EngineBridge, by_id: dict, queue: asyncio.Queue, labels: dict,
                  single: bool, table: dict) -> AsyncIterator[str]:
    samples = list(by_id.values())
    try:
        while not all(s.text.done for s in samples):
            out = await queue.get()
            s = by_id[out.request_id]
            if s.text.done:
                continue
            s.text.absorb(out)
            if s.text.done and not out.status.is_final:
                bridge.cancel([out.request_id])
            if s.text.finish_reason == "error":
                error = {"error": {"message": f"generation failed: {s.text.error}"}}
                yield "data: " + json.dumps(error) + "\n\n"
                continue
            body = _output(s, bridge, labels, final=s.text.done)
            if not single:
                body["index"] = s.index
            yield "data: " + json.dumps(body) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:  # NOTE: also on disconnect: free the engine's pages
        bridge.cancel([e for e, s in by_id.items() if not s.text.done])
        _forget(table, by_id)


def _finish_reason(s: Sample) -> dict | None:
    t = s.text
    if t.finish_reason is None:
        return None
    if t.finish_reason == "length":
        return {"type": "length", "length": s.max_new_tokens}
    if t.finish_reason == "stop":
        full = "" if t.tokenizer is None else t.tokenizer.decode(t.tokens, skip_special_tokens=t.skip)
        hits = [stop for stop in t.stops if stop and stop in full]  # NOTE: SGLang names the stop string
        if hits:
            return {"type": "stop", "matched": hits[0]}
        return {"type": "stop", "matched": t.tokens[-1] if t.tokens else None}
    if t.finish_reason == "abort":
        return {"type": "abort", "message": "aborted (abort_request, pause_generation or a disconnect)"}
    return {"type": "abort", "message": str(t.error or t.finish_reason)}


def _entries(values, ids, text: SampleText, with_text: bool) -> list:
    strings = text.token_strings(list(ids)) if with_text else [None] * len(ids)
    return [[None if v is None else max(float(v), FLOOR), int(t), x] for v, t, x in zip(values, ids, strings,
                                                                                         strict=True)]


def _output(s: Sample, bridge: EngineBridge, labels: dict, final: bool) -> dict:
    t = s.text
    version = t.versions[len(t.tokens) - 1] if t.versions and t.tokens else bridge.weight_version
    meta: dict[str, Any] = {
        "id": s.rid, "finish_reason": _finish_reason(s), "prompt_tokens": len(t.prompt_ids),
        "completion_tokens": len(t.tokens), "cached_tokens": t.cached_tokens,
        "weight_version": labels.get(version, version), "e2e_latency": time.monotonic() - s.created,
    }
    if s.logprob:
        with_text = s.with_text
        meta["output_token_logprobs"] = _entries(t.logprobs or [], t.tokens, t, with_text)
        meta["input_token_logprobs"] = _input_logprobs(s, with_text)
        if s.top_k:
            vals, tids = t.top if t.top is not None else ([], [])
            meta["output_top_logprobs"] = [_entries(v[: s.top_k], i[: s.top_k], t, with_text)
                                           for v, i in zip(vals, tids, strict=True)][: len(t.tokens)]
    if final and (routes := t.routes()) is not None:  # NOTE: AReaL reads raw int32 [P + C - 1, L * k]
        import numpy as np

        arr = routes.to("cpu").reshape(routes.shape[0], -1).int().numpy()
        meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")
    return {"text": t.text, "output_ids": list(t.tokens), "meta_info": meta}


def _input_logprobs(s: Sample, with_text: bool) -> list:
    """`[[logprob, id, text]]` of prompt positions `logprob_start_len`.. (the first prompt token's logprob is
    None), from the final output's teacher-forced scores; [] without logprob_start_len (SGLang's default)."""
    t = s.text
    if s.start < 0 or t.final is None or t.final.scores is None:
        return []
    ids = t.prompt_ids[s.start:]
    values = [None if p == 0 else t.final.scores[p - 1] for p in range(s.start, len(t.prompt_ids))]
    return _entries(values, ids, t, with_text)


def label_version(request: Request, version: int, label: str | None) -> None:
    """Name `version` as the caller's `weight_version` label (SGLang's weight updates carry one); meta_info
    and the info routes report the label for it."""
    if label is not None:
        sglang_state(request)["labels"][version] = str(label)


def version_label(request: Request, version: int) -> int | str:
    """The label a weight update gave `version` (SGLang's `weight_version`), else the version number."""
    return sglang_state(request)["labels"].get(version, version)
