"""RL control routes (vLLM dev-mode and SGLang names): pause / resume, prefix cache, sleep, weights.

Blocking work (waiting for requests to drain, copying weights, joining a process group) runs on worker
threads, so the server keeps answering other requests meanwhile. A worker thread that ran torch work gives
its OpenMP team back when done (`rollout.openmp`): an idle team slows the engine thread's steps.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Request

from ..openmp import team_released_after
from .bridge import EngineBridge
from .protocol import APIError, InitTransferRequest, UpdateFromDiskRequest, UpdateWeightsRequest
from .weights import WeightReceiver, check_update, load_checkpoint

router = APIRouter()


def _bridge(request: Request) -> EngineBridge:
    return request.app.state.bridge


def _releasing(fn):
    """`fn` for a worker thread: it frees the thread's OpenMP team once done."""

    def run(*args):
        with team_released_after():
            return fn(*args)

    return run


@router.post("/pause")
async def pause(request: Request, mode: str = "abort") -> dict:
    if mode not in ("abort", "wait", "keep"):
        raise APIError(f"mode must be one of abort, wait, keep; got {mode!r}", "mode")
    await asyncio.to_thread(_bridge(request).pause, mode)
    return {"status": "paused", "mode": mode}


@router.post("/resume")
async def resume(request: Request) -> dict:
    await asyncio.to_thread(_bridge(request).resume)
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    return {"is_paused": _bridge(request).is_paused()}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    await asyncio.to_thread(_bridge(request).reset_prefix_cache)
    return {"success": True}


@router.post("/sleep")
async def sleep(request: Request) -> dict:
    await asyncio.to_thread(_bridge(request).sleep)
    return {"success": True, "is_sleeping": True}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict:
    await asyncio.to_thread(_bridge(request).wake_up)
    return {"success": True, "is_sleeping": False}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return {"is_sleeping": _bridge(request).asleep}


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict:
    return {"weight_version": _bridge(request).weight_version}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: UpdateFromDiskRequest, request: Request) -> dict:
    bridge = _bridge(request)
    tensors = await asyncio.to_thread(_releasing(load_checkpoint), req.model_path)
    version = await _apply(bridge, tensors, "model_path")
    return {"success": True, "weight_version": version, "message": f"loaded {len(tensors)} tensors"}


async def _apply(bridge: EngineBridge, tensors, param: str) -> int:
    try:
        return await asyncio.to_thread(bridge.update_weights, tensors)
    except ValueError as e:  # NOTE: names or shapes that do not match; nothing was copied
        raise APIError(f"{param}: {e}", param) from None


# ------------------------------------------------------------------ tensor push from a trainer process
def _transfer(request: Request) -> dict:
    state = request.app.state
    if not hasattr(state, "transfer"):
        state.transfer = {"receiver": None, "pool": ThreadPoolExecutor(1, thread_name_prefix="rollout-weights"),
                          "pending": [], "error": None}
    return state.transfer


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(req: InitTransferRequest, request: Request) -> dict:
    info = req.init_info
    try:
        kwargs = dict(master_address=str(info["master_address"]), master_port=int(info["master_port"]),
                      rank_offset=int(info.get("rank_offset", 1)), world_size=int(info.get("world_size", 2)))
    except (KeyError, TypeError, ValueError) as e:
        raise APIError(f"init_info needs master_address and master_port: {e}", "init_info") from None
    t = _transfer(request)
    loop = asyncio.get_running_loop()
    try:
        t["receiver"] = await loop.run_in_executor(t["pool"], lambda: WeightReceiver(**kwargs))
    except Exception as e:
        raise APIError(f"could not join the trainer's group: {type(e).__name__}: {e}", "init_info") from None
    return {"success": True}


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict:
    t = _transfer(request)
    if t["receiver"] is None:
        raise APIError("call /init_weight_transfer_engine first", None, 409)
    t["receiver"].start()
    t["pending"], t["error"] = [], None
    return {"success": True}


@router.post("/update_weights")
async def update_weights(req: UpdateWeightsRequest, request: Request) -> dict:
    """Check one chunk's names, dtypes and shapes, then receive its tensors in the background (the trainer
    broadcasts them after this answer, or while it is pending, as vLLM's client does)."""
    t = _transfer(request)
    receiver: WeightReceiver | None = t["receiver"]
    if receiver is None or receiver.staged is None:
        raise APIError("call /init_weight_transfer_engine and /start_weight_update first", None, 409)
    view = _bridge(request).manager.core.view
    targets = dict(view.named_parameters(remove_duplicate=False))
    targets.update(dict(view.named_buffers(remove_duplicate=False)))
    info = req.update_info
    items = check_update(targets, info.get("names"), info.get("dtype_names"), info.get("shapes"))
    t["pending"].append(asyncio.get_running_loop().run_in_executor(t["pool"], _releasing(receiver.receive), items))
    return {"success": True}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict:
    t = _transfer(request)
    if t["receiver"] is None:
        raise APIError("call /init_weight_transfer_engine first", None, 409)
    pending, t["pending"] = t["pending"], []
    errors = [r for r in await asyncio.gather(*pending, return_exceptions=True) if isinstance(r, BaseException)]
    try:
        staged = t["receiver"].take()
    except RuntimeError as e:
        raise APIError(str(e), None, 409) from None
    if errors:
        raise APIError(f"weight transfer failed, old weights kept: {errors[0]}", None, 500, "server_error")
    version = await _apply(_bridge(request), staged, "update_info")
    return {"success": True, "weight_version": version}
