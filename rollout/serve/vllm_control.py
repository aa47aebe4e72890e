"""vLLM 0.32's dev-mode control routes that RL frameworks call (`VLLM_SERVER_DEV_MODE=1`), in its shapes:

- `GET /get_world_size` -> `{"world_size"}` (the engine's tensor-parallel size; `include_dp` accepted).
- `GET /weight_info` -> `{"weight_version": NAME}`; `POST /update_weight_version {"new_version": NAME}` names the
  weights serving now -> `{"success": true, "new_version"}`. Names label the engine's integer `policy_version`s:
  version 0 (a fresh server's) is "default" (vLLM's), a version loaded later without a name is its number as a
  string, and `/finish_weight_update {"weight_version": NAME}` (or SGLang's update routes' `weight_version`) names
  the version it lands. They are the
  `version` of `/inference/v1/generate`'s `weight_versions` spans (`version_spans`).
- `POST /abort_requests {"request_ids"?}`: cancels those `/inference/v1/generate` requests, or with no ids every
  request in flight -> `{"status": "aborted", "aborted": count}`.
- `POST /weight_checker {"action": "checksum" | "compare" | "reset", "baseline"?}`: `checksum` -> `{"checksums":
  {name: sha256 hex}}` of every parameter and buffer the engine runs (the bytes the forward reads, so any change of
  weights changes them) and remembers them; `compare` -> `{"match", "mismatches": [names]}` against `baseline` (a
  `checksums` dict) or the remembered ones; `reset` forgets the remembered ones.
- `GET /server_info` is SGLang's shape (`rollout.serve.sglang_control`): vLLM's clients only probe it.
- `POST /finish_session?session_id=ID` -> `{"success": true}`: the server keeps no per-session state (a session's
  stickiness lives in the pools and fleets that route it, `rollout.fleet.sessions`).
"""

from __future__ import annotations

import asyncio
import hashlib

import torch
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from rollout.serve.protocol import APIError
from rollout.serve.sglang_routes import app_sglang_state

router = APIRouter()
DEFAULT_NAME = "default"


def version_name(state, version: int) -> str:
    """The name of integer weight version `version` (see the module doc): the label a route gave it (the one
    table SGLang's routes keep too, `app_sglang_state(state)["labels"]`), else "default" for version 0, else its
    number."""
    label = app_sglang_state(state)["labels"].get(version)
    if label is not None:
        return str(label)
    return DEFAULT_NAME if version == 0 else str(version)


def name_version(state, version: int, name: str) -> None:
    app_sglang_state(state)["labels"][version] = name


def version_spans(state, versions: list[int]) -> list[dict]:
    """Per-token versions as vLLM's spans `[{version, start, end}]` (end exclusive), one per run of equal ones."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["_v"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"_v": v, "version": None, "start": i, "end": i + 1})
    for span in spans:
        span["version"] = version_name(state, span.pop("_v"))
    return spans


def registry(state) -> dict[str, list[str]]:
    """Client request id (and its `generate-tokens-` form) -> the engine ids of its samples, while in flight."""
    if not hasattr(state, "generate_ids"):
        state.generate_ids = {}
    return state.generate_ids


def abort(state, request_ids: list[str]) -> int:
    """Cancel the samples of these client request ids (either form); returns how many requests were found."""
    table = registry(state)
    found = [table[r] for r in request_ids if r in table]
    for rids in found:
        state.bridge.cancel(rids)
    return len(found)


class NewVersion(BaseModel):
    model_config = ConfigDict(extra="ignore")

    new_version: str = Field(min_length=1)


class AbortAll(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_ids: list[str] | None = None


class CheckerRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    action: str
    baseline: dict[str, str] | None = None


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = True) -> dict:
    tp = request.app.state.bridge.engine.tensor_parallel
    return {"world_size": 1 if tp is None else int(tp.size)}


@router.get("/weight_info")
async def weight_info(request: Request) -> dict:
    state = request.app.state
    return {"weight_version": version_name(state, state.bridge.weight_version)}


@router.post("/update_weight_version")
async def update_weight_version(req: NewVersion, request: Request) -> dict:
    state = request.app.state
    name_version(state, state.bridge.weight_version, req.new_version)
    return {"success": True, "new_version": req.new_version}


@router.post("/abort_requests")
async def abort_requests(request: Request, req: AbortAll | None = None) -> dict:
    state = request.app.state
    if req is None or req.request_ids is None:
        return {"status": "aborted", "aborted": state.bridge.cancel_all()}
    return {"status": "aborted", "aborted": abort(state, req.request_ids)}


def checksums(targets: dict) -> dict[str, str]:
    """sha256 of each tensor's bytes, by name."""
    out = {}
    for name, t in sorted(targets.items()):
        data = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.sha256(data).hexdigest()
    return out


@router.post("/weight_checker")
async def weight_checker(req: CheckerRequest, request: Request) -> dict:
    state = request.app.state
    if req.action == "reset":
        state.weight_checksums = None
        return {"success": True}
    if req.action not in ("checksum", "compare"):
        raise APIError(f"action must be 'checksum', 'compare' or 'reset', got {req.action!r}", "action")
    now = await asyncio.to_thread(lambda: checksums(state.bridge.weight_targets()))
    if req.action == "checksum":
        state.weight_checksums = now
        return {"checksums": now}
    baseline = req.baseline if req.baseline is not None else getattr(state, "weight_checksums", None)
    if baseline is None:
        raise APIError("compare needs a baseline: send one, or call action 'checksum' first", "baseline")
    names = sorted(set(baseline) | set(now))
    mismatches = [n for n in names if baseline.get(n) != now.get(n)]
    return {"match": not mismatches, "mismatches": mismatches}


@router.post("/finish_session")
async def finish_session(session_id: str | None = None) -> dict:
    return {"success": True, "session_id": session_id}
