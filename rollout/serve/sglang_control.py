"""SGLang's native control and info routes (`rollout.serve.sglang_routes` serves `/generate`):

- `GET /server_info` + `/get_server_info`, `GET /model_info` + `/get_model_info` (sglang-router probes
  `/health`, `/server_info` and `/model_info` when a worker registers), `GET /health_generate`.
- `POST /pause_generation {mode: abort|retract|in_place}`: "abort" (SGLang's default) cancels the requests in
  flight, which answer with finish_reason abort; "in_place" and "retract" keep them, frozen with their KV
  (the engine's pause mode "keep"), to go on after `POST /continue_generation`.
- `POST /abort_request {rid | abort_all}`, `GET|POST /flush_cache` (the prefix cache; a 400 while requests are
  frozen in place, as SGLang refuses while requests run), `POST /release_memory_occupation` /
  `/resume_memory_occupation` (the engine's sleep / wake; tags checked, every tag releases the KV cache).
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from rollout.serve.bridge import EngineBridge
from rollout.serve.protocol import APIError
from rollout.serve.sglang_routes import sglang_sampling, sglang_state, version_label

router = APIRouter()


def _server_info(request: Request) -> dict:
    state = request.app.state
    bridge: EngineBridge = state.bridge
    version = bridge.weight_version
    return {
        "model_path": state.model_root, "tokenizer_path": state.model_root, "served_model_name":
            state.served_model_name, "context_length": bridge.max_model_len, "max_total_num_tokens":
            bridge.max_model_len, "weight_version": version_label(request, version),
        "is_paused": bridge.is_paused(), "is_sleeping": bridge.asleep, "engine": "rollout",
        "internal_states": [bridge.cache_stats()], "version": _version(),
    }


def _version() -> str:
    try:
        return version("rollout")
    except PackageNotFoundError:
        return "unknown"


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict:
    return _server_info(request)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict:
    state = request.app.state
    version = state.bridge.weight_version
    return {"model_path": state.model_root, "tokenizer_path": state.model_root, "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": version_label(request, version),
            "has_image_understanding": False, "has_audio_understanding": False}


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once the engine answers a one-token greedy request (at once while paused or asleep: a request
    would wait for the resume; the engine thread's liveness is what is checked then)."""
    bridge: EngineBridge = request.app.state.bridge
    if not bridge.manager.is_running():
        return Response(status_code=503)
    if bridge.is_paused() or bridge.asleep:
        return Response(status_code=200)
    queue: asyncio.Queue = asyncio.Queue()
    sp = sglang_sampling({"max_new_tokens": 1, "temperature": 0.0})
    ids = bridge.submit([([0], bridge.sampling(sp, 1, 0, 0))], False, queue)
    try:
        out = await asyncio.wait_for(queue.get(), 20.0)
    except asyncio.TimeoutError:
        bridge.cancel(ids)
        return Response(status_code=503)
    return Response(status_code=200 if out.finish_reason != "error" else 503)


# ------------------------------------------------------------------------------------------- control
class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    mode: str = "abort"


PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}


@router.post("/pause_generation")
async def pause_generation(request: Request, req: PauseRequest | None = None) -> dict:
    """SGLang's modes: "abort" (default) cancels the requests in flight (they answer with finish_reason
    abort); "in_place" and "retract" keep them, frozen with their KV, to go on after /continue_generation."""
    mode = (req or PauseRequest()).mode
    if mode not in PAUSE_MODES:
        raise APIError(f"mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}", "mode")
    await asyncio.to_thread(request.app.state.bridge.pause, PAUSE_MODES[mode])
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict:
    await asyncio.to_thread(request.app.state.bridge.resume)
    return {"message": "Generation continued successfully.", "status": "ok"}


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: str | None = ""
    abort_all: bool = False


@router.post("/abort_request")
async def abort_request(req: AbortRequest, request: Request) -> Response:
    """Cancel request `rid` (all its samples), or every request with `abort_all`; an unknown or finished
    rid is a no-op, as in SGLang. The aborted requests answer with finish_reason {"type": "abort"}."""
    bridge: EngineBridge = request.app.state.bridge
    table = sglang_state(request)["rids"]
    if req.abort_all:
        ids = [eid for eids in table.values() for eid in eids]
    elif req.rid:
        ids = list(table.get(req.rid, ()))
    else:
        raise APIError("send rid or abort_all: true", "rid")
    bridge.cancel(sorted(set(ids)))
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> PlainTextResponse:
    """The prefix cache emptied (after the requests in flight finish; with requests frozen by a keep pause it
    is refused with 400, as SGLang refuses while requests run)."""
    bridge: EngineBridge = request.app.state.bridge
    if bridge.manager.pause_mode == "keep" and bridge.is_paused():
        return PlainTextResponse("Cache not flushed: requests are paused in place; continue or abort them "
                                 "first.\n", status_code=400)
    await asyncio.to_thread(bridge.reset_prefix_cache)
    return PlainTextResponse("Cache flushed.\n")


class MemoryRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tags: list[str] | None = None


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def _tags(req: MemoryRequest | None) -> None:
    bad = [t for t in (req.tags if req and req.tags else ()) if t not in MEMORY_TAGS]
    if bad:
        raise APIError(f"tags must be among {list(MEMORY_TAGS)}, got {bad}", "tags")


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request, req: MemoryRequest | None = None) -> dict:
    """The engine's sleep (its KV cache released; every tag releases it, the weights stay)."""
    _tags(req)
    await asyncio.to_thread(request.app.state.bridge.sleep)
    return {"success": True, "message": "released"}


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request, req: MemoryRequest | None = None) -> dict:
    _tags(req)
    await asyncio.to_thread(request.app.state.bridge.wake_up)
    return {"success": True, "message": "resumed"}


