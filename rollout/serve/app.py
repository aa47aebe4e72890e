"""`build_app`: the FastAPI app over one `RolloutEngine`: routes, API-key and body-size guard, errors.

Every error is `{"error": {"message", "type", "param", "code"}}`; bad input is a 400 naming the field.

The API key guards the `/v1/` routes, `/tokenize` / `/detokenize`, the RL control routes and `/openapi.json`.
Open without it: `/health`, `/ping`, `/version`, and `/metrics` as `vllm serve` leaves it for Prometheus
scrapers (`metrics_require_api_key=True`, the CLI's `--metrics-require-api-key`, puts it behind the key).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.api.engine import RolloutEngine
from rollout.serve import (
    control,
    lora_routes,
    openai_routes,
    render,
    sglang_control,
    sglang_routes,
    sglang_weights,
    tito,
    vllm_control,
    vllm_routes,
)
from rollout.serve.bridge import EngineBridge
from rollout.serve.metrics import make_registry
from rollout.serve.protocol import APIError, error_body, validation_error
from rollout.serve.tools import TOOL_CALL_PARSERS

logger = logging.getLogger("rollout.serve")

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
METRICS_PATH = "/metrics"


class Guard:
    """ASGI middleware: a Bearer key on every path but `open_paths`, and a cap on request body size.

    The body is read here (up to `max_body_bytes`, else 413) and replayed to the app, so an oversized or
    unauthorised request never reaches a handler."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app, self.api_key, self.max_body_bytes, self.open_paths = app, api_key, max_body_bytes, open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"] not in self.open_paths:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await _reply(send, 401, error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                                          None, 401, "authentication_error"))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_body(f"request body over {self.max_body_bytes} bytes", "body", 413)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _reply(send, 413, too_big)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await _reply(send, 413, too_big)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # NOTE: later messages (http.disconnect) still reach the app

        return await self.app(scope, replay, send)


class VersionHeader:
    """ASGI middleware: every `/v1/` response carries `X-Weight-Version`, the engine's `policy_version` when the
    response starts (for a non-streamed completion: once its samples are done), so a client that feeds token
    ids and takes token ids back also knows which weights answered."""

    def __init__(self, app, bridge: EngineBridge) -> None:
        self.app, self.bridge = app, bridge

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def send_versioned(message) -> None:
            if message["type"] == "http.response.start":
                version = str(self.bridge.weight_version).encode()
                message = {**message, "headers": [*message.get("headers", ()), (b"x-weight-version", version)]}
            await send(message)

        return await self.app(scope, receive, send_versioned)


async def _reply(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def build_app(engine: RolloutEngine, tokenizer=None, served_model_name: str = "model", api_key: str | None = None,
              max_model_len: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              tool_call_parser: str | None = None, model_root: str | None = None,
              metrics_require_api_key: bool = False, enable_return_routed_experts: bool = False) -> FastAPI:
    """The server app over `engine` (which the caller owns and closes).

    Args:
        engine: a running `RolloutEngine`; its generation config's EOS ids end samples unless `ignore_eos`.
        tokenizer: encodes string prompts and chat messages, decodes text (None: token ids only).
        served_model_name: the name `/v1/models` lists and requests must use (or omit).
        api_key: when set, every route but /health, /ping, /version and /metrics needs
            `Authorization: Bearer <api_key>`.
        max_model_len: cap on prompt + max_tokens (None: the model's context).
        max_body_bytes: larger request bodies get a 413.
        tool_call_parser: parse chat outputs into `tool_calls` with this parser ("hermes";
            `rollout.serve.tools`), None to return tool calls as text.
        model_root: the model's path, `root` of its `/v1/models` entry (None: `served_model_name`).
        metrics_require_api_key: put `/metrics` behind `api_key` too.
        enable_return_routed_experts: every non-streamed choice carries `routed_experts` (vLLM's flag; a request
            asks alone with `return_routed_experts`); ValueError naming it on a dense model.
    """
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
    # NOTE: the OpenAPI schema at /openapi.json (behind the key, as every route but the open ones), as `vllm serve`
    # publishes it, for client generators and API fuzzers; no docs pages.
    app = FastAPI(title="rollout serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    bridge = EngineBridge(engine, max_model_len, enable_return_routed_experts)
    app.state.bridge = bridge
    app.state.tokenizer = tokenizer
    app.state.served_model_name = served_model_name
    app.state.tool_call_parser = tool_call_parser
    app.state.model_root = model_root or served_model_name
    registry = make_registry(bridge)
    app.include_router(openai_routes.router)
    app.include_router(control.router)
    app.include_router(vllm_routes.router)
    app.include_router(lora_routes.router)
    for sglang in (sglang_routes, sglang_control, sglang_weights):  # NOTE: SGLang's native API
        app.include_router(sglang.router)
    for module in (tito, render, vllm_control):  # NOTE: vLLM 0.32's token-in/token-out, derender, dev-mode control
        app.include_router(module.router)

    @app.get("/health")
    async def health() -> Response:
        ok = engine.manager.is_running()
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await asyncio.to_thread(generate_latest, registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), None, e.status_code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", None, 500, "server_error"),
                            status_code=500)

    app.add_middleware(VersionHeader, bridge=bridge)
    open_paths = OPEN_PATHS if metrics_require_api_key else OPEN_PATHS | {METRICS_PATH}
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, open_paths=open_paths)
    return app
