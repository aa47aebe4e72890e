"""Request models of the OpenAI routes (vLLM's field names) and OpenAI-shaped errors.

Every field is checked here, so a bad request is refused with a 400 naming the field before it reaches
the engine. Unknown fields are ignored, as vLLM does, so clients that send extra keys keep working.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 256  # samples per prompt
MAX_LOGPROBS = 20  # top logprobs per position (vLLM's default cap)
TopK = Annotated[int, Field(ge=0, le=MAX_LOGPROBS, strict=True)]


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_

    def body(self) -> dict:
        return error_body(self.message, self.param, self.status, self.type)


def error_body(message: str, param: str | None, status: int, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic/FastAPI error as an APIError naming its top-level field."""
    if not errors:
        return APIError("invalid request")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return APIError(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", "body")
    param = str(loc[0]) if loc and isinstance(loc[0], str) else "body"
    if param == "sampling_params" and len(loc) > 1 and isinstance(loc[1], str):
        param = f"sampling_params.{loc[1]}"  # NOTE: /inference/v1/generate's nested fields, named in full
    if param == "prompt":
        return APIError("prompt must be a string, a list of strings, a list of token ids (ints) or a list of "
                        "lists of token ids", param)
    return APIError(f"{param}: {err.get('msg', 'invalid value')}", param)


Prob = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TokenIds = Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    top_p: Prob = 1.0
    top_k: Annotated[int, Field(ge=-1, strict=True)] = -1  # -1 or 0: off
    seed: Annotated[int, Field(strict=True)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N, strict=True)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    return_routed_experts: bool = False  # MoE: each choice's `routed_experts` (`rollout.api.route_wire`)
    skip_special_tokens: bool = True
    return_sampling_mask: bool = False  # per token, the ids the sampler could draw (`sampling_mask`)
    # vLLM's sampling fields, its names and ranges (rollout.sampling.processors applies them)
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] = 0.0
    min_tokens: Annotated[int, Field(ge=0, strict=True)] = 0
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None  # token id -> bias
    bad_words: list[str] | None = None  # words never generated (tokenized as vLLM does)
    # vLLM / OpenAI fields that change the output in ways the engine does not implement: a 400 naming them
    use_beam_search: Any = None
    best_of: Any = None
    num_beams: Any = None
    allowed_token_ids: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("use_beam_search", "best_of", "num_beams", "allowed_token_ids", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "structured_outputs", mode="before")
    @classmethod
    def _unsupported(cls, v: Any, info) -> Any:
        if v is None or v is False or (info.field_name in ("best_of", "num_beams") and v == 1):
            return v
        raise ValueError(f"{info.field_name}={v!r} is not supported by the rollout engine")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """`usage` on every streamed chunk (vLLM: `continuous_usage_stats`, with `include_usage`)."""
        return self.include_usage and bool(self.stream_options.get("continuous_usage_stats"))


class CompletionRequest(SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0, strict=True)] | None = 16  # 0 only with echo (scoring)
    logprobs: TopK | None = None  # N: the N most likely tokens of each position besides the chosen one
    # NOTE: vLLM's: logprobs.tokens (and top_logprobs keys) as "token_id:N" (AReaL's vLLM backend reads them)
    return_tokens_as_token_ids: bool = False

    @field_validator("logprobs", mode="before")
    @classmethod
    def _bool_logprobs(cls, v: Any) -> Any:
        """`logprobs: true` (SkyRL's Tinker client, AReaL) is 1 and false 0, as vLLM's lax int reads them."""
        return int(v) if isinstance(v, bool) else v
    echo: bool = False  # the prompt is returned before the completion (its logprobs too with `logprobs`)
    prompt_logprobs: TopK | None = None  # vLLM's: per prompt token, its logprob and the top N

    @model_validator(mode="after")
    def _scoring(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens: 0 is only allowed with echo (scoring the prompt)", "max_tokens")
        if self.echo and self.stream:
            raise APIError("echo is not supported with stream", "echo")
        return self

    @property
    def scores_prompt(self) -> bool:
        """The prompt's own logprobs are needed (echo with logprobs, or prompt_logprobs)."""
        return (self.echo and self.logprobs is not None) or self.prompt_logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        return max(self.logprobs or 0, self.prompt_logprobs or 0, 1 if self.prompt_logprobs is not None else 0)

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" (rollout.serve.tools)
    parallel_tool_calls: bool | None = None  # NOTE: accepted as vLLM does; every parsed call is returned
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    max_completion_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    logprobs: bool = False
    top_logprobs: TopK | None = None  # the N most likely tokens of each position (with logprobs=true)

    @field_validator("messages")
    @classmethod
    def _roles(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return check_messages(v)

    @model_validator(mode="after")
    def _alias(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def scores_prompt(self) -> bool:
        return False

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


def check_messages(v: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as the chat template sees them: each with a string role; null content as "".
    Content parts are checked where the template is known (`rollout.api.content`)."""
    for i, m in enumerate(v):
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
    # NOTE: an assistant turn that only calls tools may omit its content or send null (the OpenAI Agents
    # SDK does); as vLLM, the template sees "" (templates index m['content'] directly).
    return [m if m.get("content") is not None else {**m, "content": ""} for m in v]


class UpdateFromDiskRequest(BaseModel):
    model_path: Annotated[str, Field(min_length=1)]
    abort_all_requests: bool = False  # SGLang's: cancel the requests in flight (the `in_flight` query wins if set)
    weight_version: str | None = None  # SGLang's: a label for the new version (`rollout.serve.sglang_routes`)


class InitTransferRequest(BaseModel):
    init_info: dict[str, Any]


class UpdateWeightsRequest(BaseModel):
    update_info: dict[str, Any]


class FinishWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    weight_version: Annotated[str, Field(min_length=1)] | None = None  # vLLM's: names the version it lands
