"""RL control routes (vLLM dev-mode and SGLang names): pause / resume, prefix cache, sleep, weights.

Blocking work (waiting for requests to drain, copying weights, joining a process group) runs on worker
threads, so the server keeps answering other requests meanwhile. A worker thread that ran torch work gives
its OpenMP team back when done (`rollout.engine.openmp`): an idle team slows the engine thread's steps.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Request

from rollout.engine.openmp import team_released_after
from rollout.in_flight import PAUSE_DEFAULT, UPDATE_DEFAULT, check_mode
from rollout.serve.bridge import EngineBridge
from rollout.serve.lora_routes import (
    StartWeightUpdateRequest,
    apply_lora_push,
    check_lora_chunk,
    check_lora_push,
)
from rollout.serve.protocol import (
    APIError,
    FinishWeightUpdateRequest,
    InitTransferRequest,
    UpdateFromDiskRequest,
    UpdateWeightsRequest,
)
from rollout.serve.sglang_routes import label_version
from rollout.serve.weights import WeightReceiver, check_update, load_checkpoint

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
async def pause(request: Request, mode: str = PAUSE_DEFAULT) -> dict:
    """vLLM's `POST /pause?mode=abort|wait|keep` (`rollout.in_flight`; default "abort")."""
    _mode(mode, "mode")
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
async def update_weights_from_disk(req: UpdateFromDiskRequest, request: Request,
                                   in_flight: str | None = None) -> dict:
    bridge = _bridge(request)
    in_flight = in_flight or ("abort" if req.abort_all_requests else UPDATE_DEFAULT)
    _mode(in_flight, "in_flight")  # NOTE: before the checkpoint is read
    tensors = await asyncio.to_thread(_releasing(load_checkpoint), req.model_path)
    tp = bridge.engine.tensor_parallel  # NOTE: the other ranks load the same checkpoint (rollout.serve.tp)
    if tp is not None:
        tp.record_load(bridge.weight_version + 1, req.model_path)
    try:
        version = await _apply(bridge, tensors, "model_path", in_flight)
    except BaseException:
        if tp is not None:
            tp.forget_load(bridge.weight_version + 1)
        raise
    label_version(request, version, req.weight_version)
    return {"success": True, "weight_version": version, "message": f"loaded {len(tensors)} tensors",
            "num_paused_requests": 0}


def _mode(mode: str, param: str) -> None:
    try:
        check_mode(mode, param)
    except ValueError as e:
        raise APIError(str(e), param) from None


async def _apply(bridge: EngineBridge, tensors, param: str, in_flight: str = UPDATE_DEFAULT) -> int:
    """`in_flight` (query parameter of the update routes, `rollout.in_flight`): "wait" (default) finishes the
    running requests under the old weights first, "abort" cancels them, "keep" lands the weights between two
    engine steps and they go on under the new ones (KV kept); checked by the routes before they read anything."""
    try:
        return await asyncio.to_thread(bridge.update_weights, tensors, in_flight)
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
    """Join the trainer's group as rank `rank_offset` of `world_size` (one broadcast can feed several servers);
    `backend` "gloo" (default) or "nccl" (the engine on CUDA); `timeout_s` bounds the join and each receive.
    A group this server was already in is left first."""
    info = req.init_info
    try:
        kwargs = dict(master_address=str(info["master_address"]), master_port=int(info["master_port"]),
                      rank_offset=int(info.get("rank_offset", 1)), world_size=int(info.get("world_size", 2)),
                      timeout_s=float(info.get("timeout_s", 120.0)), backend=str(info.get("backend", "gloo")))
    except (KeyError, TypeError, ValueError) as e:
        raise APIError(f"init_info needs master_address and master_port: {e}", "init_info") from None
    if not 1 <= kwargs["rank_offset"] < kwargs["world_size"]:
        raise APIError(f"init_info: rank_offset {kwargs['rank_offset']} outside [1, world_size "
                       f"{kwargs['world_size']})", "init_info")
    device = _bridge(request).engine.device
    if kwargs["backend"] == "nccl" and device.type != "cuda":
        raise APIError("init_info: backend 'nccl' needs the engine on a CUDA device; this one runs on "
                       f"{device.type} (use 'gloo')", "init_info")
    _close(request)
    t = _transfer(request)
    loop = asyncio.get_running_loop()
    try:
        t["receiver"] = await loop.run_in_executor(t["pool"], lambda: WeightReceiver(**kwargs, device=device))
    except Exception as e:
        raise APIError(f"could not join the trainer's group: {type(e).__name__}: {e}", "init_info") from None
    return {"success": True}


@router.post("/close_communicator")
async def close_communicator(request: Request) -> dict:
    """Leave the trainer's group (TRL's name), abandoning a transfer in progress; the weights serving stay."""
    return {"success": True, "closed": _close(request)}


def _close(request: Request) -> bool:
    state = request.app.state
    t = getattr(state, "transfer", None)
    if t is None or t["receiver"] is None:
        return False
    # NOTE: a receive stuck on a dead trainer holds the old worker until its timeout; a new pool serves on.
    t["pool"].shutdown(wait=False, cancel_futures=True)
    del state.transfer
    return True


@router.post("/start_weight_update")
async def start_weight_update(request: Request, req: StartWeightUpdateRequest | None = None) -> dict:
    """With `lora_name`, the push is a LoRA adapter's (`rollout.serve.lora_routes`)."""
    t = _transfer(request)
    if t["receiver"] is None:
        raise APIError("call /init_weight_transfer_engine first", None, 409)
    lora = check_lora_push(request.app.state, req)
    t["receiver"].start()
    t["pending"], t["error"], t["lora"] = [], None, lora
    return {"success": True}


@router.post("/update_weights")
async def update_weights(req: UpdateWeightsRequest, request: Request) -> dict:
    """Check one chunk's names, dtypes and shapes, then receive its tensors in the background (the trainer
    broadcasts them after this answer, or while it is pending, as vLLM's client does)."""
    t = _transfer(request)
    receiver: WeightReceiver | None = t["receiver"]
    if receiver is None or receiver.staged is None:
        raise APIError("call /init_weight_transfer_engine and /start_weight_update first", None, 409)
    info = req.update_info
    if t.get("lora") is not None:
        items = check_lora_chunk(info)
    else:
        items = check_update(_bridge(request).weight_targets(), info.get("names"), info.get("dtype_names"),
                             info.get("shapes"))
    packed = bool(info.get("packed", False))  # NOTE: vLLM's name: the chunk comes as one flat buffer
    if packed and len({dtype for _, dtype, _ in items}) > 1:
        raise APIError("update_info: a packed chunk holds tensors of one dtype", "update_info")
    receive = receiver.receive_packed if packed else receiver.receive
    if items:
        t["pending"].append(asyncio.get_running_loop().run_in_executor(t["pool"], _releasing(receive), items))
    return {"success": True}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, in_flight: str = UPDATE_DEFAULT,
                               req: FinishWeightUpdateRequest | None = None) -> dict:
    """`weight_version` (vLLM's, optional) names the version it lands (`rollout.serve.vllm_control`)."""
    _mode(in_flight, "in_flight")  # NOTE: refused before the staged tensors are taken; a retry can apply them
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
    lora, t["lora"] = t.get("lora"), None
    if lora is not None:
        return await apply_lora_push(request.app.state, lora, staged, in_flight)
    version = await _apply(_bridge(request), staged, "update_info", in_flight)
    label_version(request, version, None if req is None else req.weight_version)
    return {"success": True, "weight_version": version}
