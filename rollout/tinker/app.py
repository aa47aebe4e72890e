"""The Tinker REST routes (`/api/v1/...`, the SDK 0.38's), on a `Service`.

Every route but `/api/v1/healthz` needs the API key (the SDK's `X-API-Key`, or `Authorization: Bearer`).
A request that is wrong at once (bad JSON, unknown ids, bad fields) gets a 400 `{"error", "detail"}`, which
the SDK raises as `BadRequestError`; one that fails while it runs fails its future (`RequestFailedError`).
Results the SDK reads as protobuf (`ForwardBackwardOutput`, `SampleResponse`) are sent as
`application/x-protobuf`, the others as JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rollout.tinker.service import Service
from rollout.tinker.wire import PROTO_TYPE, UserError

logger = logging.getLogger("rollout.tinker")

CLIENT_CONFIG = {  # NOTE: the SDK's ClientConfigResponse flags this server supports
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "sample_no_retries": False,
}


def build_app(service: Service, api_key: str | None, max_body_bytes: int = 256 * 2**20):
    app = FastAPI(title="rollout tinker-serve")
    app.state.service = service

    def error(status: int, message: str):
        return JSONResponse({"error": message, "detail": message}, status_code=status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key and request.url.path != "/api/v1/healthz":
            given = request.headers.get("x-api-key") or ""
            auth = request.headers.get("authorization") or ""
            if auth.lower().startswith("bearer "):
                given = given or auth[7:]
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return error(401, "missing or wrong API key (X-API-Key: tml-...)")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            return error(413, f"request body over {max_body_bytes} bytes")
        return await call_next(request)

    @app.exception_handler(UserError)
    async def user_error(request: Request, e: UserError):
        return error(400, str(e))

    async def body_json(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise UserError(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise UserError("the body must be a JSON object")
        return body

    def future(rid: str, **extra):
        return {"request_id": rid, **extra}

    def json_route(name: str, returns_future: bool) -> None:
        """`POST /api/v1/{name}`: its JSON body to `service.{name}`, whose answer is the reply, or for a route that
        runs in the background the id of the future the SDK polls (`retrieve_future`)."""
        method = getattr(service, name)

        async def route(request: Request):
            result = method(await body_json(request))
            return future(result) if returns_future else result

        route.__name__ = name  # NOTE: FastAPI names the operation after its function
        app.post(f"/api/v1/{name}")(route)

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {
            "supported_models": [
                {
                    "model_name": service.base_model,
                    "max_context_length": service.max_context,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    @app.post("/api/v1/client/config")
    async def client_config():
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        body = await body_json(request)
        s = service.session(body.get("session_id"))
        if s["finished"]:
            return error(410, f"session {body.get('session_id')!r} has finished")
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str):
        service.session(session_id)["finished"] = True
        return {}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = await body_json(request)
        rid = service.create_model(body)
        return future(rid, model_id=f"{body['session_id']}:train:{body['model_seq_id']}")

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        body = await request.body()
        if (request.headers.get("content-encoding") or "").lower() == "zstd":
            import zstandard

            try:
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=max_body_bytes)
            except zstandard.ZstdError as e:
                raise UserError(f"forward_backward: bad zstd body ({e})") from None
        if PROTO_TYPE not in (request.headers.get("content-type") or ""):
            raise UserError(f"forward_backward takes a {PROTO_TYPE} body (tinker SDK >= 0.38)")
        return future(service.forward_backward(body))

    for name in ("create_session", "get_info", "create_sampling_session", "asample"):
        json_route(name, returns_future=False)
    for name in ("optim_step", "save_weights", "load_weights", "save_weights_for_sampler"):
        json_route(name, returns_future=True)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        return service.get_sampler(sampler_id)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await body_json(request)
        rid = body.get("request_id")
        fut = service.future(rid)
        deadline = time.monotonic() + service.poll_s
        while not fut.done.is_set() and time.monotonic() < deadline:  # NOTE: a long poll, off the thread pool
            await asyncio.sleep(0.005)
        if not fut.done.is_set():
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        if fut.error is not None:
            return {"error": fut.error, "category": fut.category}
        if fut.kind == "proto":
            return Response(fut.result, media_type=PROTO_TYPE)
        return fut.result

    return app
