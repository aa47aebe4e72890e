"""vLLM's LoRA routes (`vllm serve BASE --enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`):

- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`: a PEFT directory (`save_pretrained`), loaded unmerged
  beside the base model (`RolloutEngine.add_lora`); 200 with a text body as vLLM's. A second load of a name is
  a 400 (vLLM's), unless `"load_inplace": true`, which replaces its tensors (`update_lora`).
- `POST /v1/unload_lora_adapter {"lora_name"}`: once the requests in flight finished; an unknown name is a 404.
- `"model": lora_name` in `/v1/completions` and `/v1/chat/completions` runs that adapter (`lora_of`), and
  `/v1/models` lists each adapter with its path as `root` and the base model as `parent` (`model_entries`).

Beyond vLLM, an adapter push in memory over the weight-transfer path (`RolloutClient.push_lora`,
`WeightBroadcaster.broadcast_lora`): `/start_weight_update {"lora_name", "lora_config"}`, the adapter's tensors
through `/update_weights` chunks, and `/finish_weight_update` adds or updates it and answers its `lora_version`.

`rollout serve BASE --enable-lora [--max-loras K] [--max-lora-rank R]` turns them on (K defaults to 1, as
vLLM's); without it a load is a 400 naming the flag. Every bad request is a 4xx naming the problem.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from rollout.serve.protocol import APIError

router = APIRouter()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # NOTE: vLLM's; names are what rollout keys adapters by


def _paths(state) -> dict[str, str]:
    if not hasattr(state, "lora_paths"):
        state.lora_paths = {}
    return state.lora_paths


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoraRequest, request: Request) -> PlainTextResponse:
    state = request.app.state
    engine = state.bridge.engine
    if engine.manager.config.max_loras < 1:
        raise APIError("LoRA is not enabled on this server: start it with --enable-lora", "lora_name")
    if req.lora_name == state.served_model_name:
        raise APIError(f"lora_name {req.lora_name!r} is the base model's name", "lora_name")
    known = req.lora_name in {i.name for i in engine.list_loras()}
    if known and not req.load_inplace:
        raise APIError(f"The lora adapter '{req.lora_name}' has already been loaded. If you want to load the "
                       "adapter in place, set 'load_inplace' to True.", "lora_name")
    try:
        if known:
            await asyncio.to_thread(engine.update_lora, req.lora_name, req.lora_path)
        else:
            await asyncio.to_thread(engine.add_lora, req.lora_name, req.lora_path)
    except ValueError as e:
        raise APIError(str(e), "lora_path" if "directory" in str(e) else "lora_name") from None
    _paths(state)[req.lora_name] = req.lora_path
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    state = request.app.state
    engine = state.bridge.engine
    if req.lora_name not in {i.name for i in engine.list_loras()}:
        raise APIError(f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name", 404, "NotFoundError")
    await asyncio.to_thread(engine.remove_lora, req.lora_name)
    _paths(state).pop(req.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


class StartWeightUpdateRequest(BaseModel):
    """`/start_weight_update`'s optional body: with `lora_name` the push that follows is that adapter's tensors
    (PEFT names, `<module>.lora_A.weight` / `.lora_B.weight`) and `lora_config` its LoraConfig fields; the finish
    adds or updates the adapter in memory, never through a file."""

    model_config = ConfigDict(extra="ignore")

    is_checkpoint_format: bool = True
    lora_name: str | None = Field(default=None, min_length=1)
    lora_config: dict | None = None


def check_lora_push(state, req: StartWeightUpdateRequest | None) -> tuple[str, dict] | None:
    """(adapter name, its config fields) when `/start_weight_update` opens an adapter push; a 400 naming the
    problem (LoRA off, the base model's name)."""
    if req is None or req.lora_name is None:
        return None
    if state.bridge.engine.manager.config.max_loras < 1:
        raise APIError("LoRA is not enabled on this server: start it with --enable-lora", "lora_name")
    if req.lora_name == state.served_model_name:
        raise APIError(f"lora_name {req.lora_name!r} is the base model's name", "lora_name")
    return req.lora_name, dict(req.lora_config or {})


def check_lora_chunk(info: dict) -> list:
    """A pushed adapter chunk's [(name, dtype, shape)]: LoRA tensor names, 2-D shapes (the table checks the rest
    at the finish, before anything is copied)."""
    names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) \
            or not len(names) == len(dtypes) == len(shapes):
        raise APIError("update_info needs lists 'names', 'dtype_names' and 'shapes' of one length", "update_info")
    out = []
    for name, dname, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, str(dname).removeprefix("torch."), None)
        if not str(name).endswith((".lora_A.weight", ".lora_B.weight")) or not isinstance(dtype, torch.dtype):
            raise APIError(f"update_info: {name!r} ({dname}) is not a LoRA tensor (<module>.lora_A.weight / "
                           ".lora_B.weight, a float dtype)", "update_info")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
            raise APIError(f"update_info: {name!r} has shape {shape}; a LoRA tensor is 2-D", "update_info")
        out.append((str(name), dtype, tuple(shape)))
    return out


async def apply_lora_push(state, lora: tuple[str, dict], tensors: dict, in_flight: str) -> dict:
    """Add (first push of a name) or update (in_flight as `update_weights`) the pushed adapter; its version."""
    name, config = lora
    engine = state.bridge.engine
    try:
        if name in {i.name for i in engine.list_loras()}:
            version = await asyncio.to_thread(engine.update_lora, name, tensors, config, in_flight)
        else:
            version = (await asyncio.to_thread(engine.add_lora, name, tensors, config)).version
    except ValueError as e:
        raise APIError(f"LoRA push, old adapter kept: {e}", "update_info") from None
    _paths(state)[name] = f"(pushed, version {version})"
    return {"success": True, "weight_version": state.bridge.weight_version, "lora_name": name, "lora_version": version}


def lora_of(model: str | None, state) -> str | None:
    """The adapter a request's `model` names (None: the base model); a 400 naming an unknown model."""
    if model is None or model == state.served_model_name:
        return None
    if model in {i.name for i in state.bridge.engine.list_loras()}:
        return model
    raise APIError(f"The model `{model}` does not exist; this server serves {state.served_model_name!r}"
                   f"{' and LoRA adapters ' + str(sorted(_paths(state))) if _paths(state) else ''}", "model")


def model_entries(state, base: dict) -> list[dict]:
    """`/v1/models`: the base model's entry, then one per adapter (vLLM's shape: `root` its path, `parent` the base)."""
    entries = [base]
    for info in state.bridge.engine.list_loras():
        entries.append({**base, "id": info.name, "root": _paths(state).get(info.name, info.name),
                        "parent": state.served_model_name})
    return entries
