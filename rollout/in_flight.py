"""What happens to the requests in flight when the engine pauses or its weights change: one vocabulary for
every layer, vLLM's `POST /pause?mode=abort|wait|keep`.

- "abort": the running and queued requests are cancelled at once; each delivers its final CANCELLED result
  with the tokens it had.
- "wait": they run to their end first (under the old weights, for an update); new requests are held until
  then (until `resume()`, for a pause).
- "keep": they stay where they are. A pause freezes them (no step runs; they go on after `resume()`); an
  update lands between two engine steps and they go on under the new weights, their KV kept.

Who takes a mode, and its default:

- pause, default "abort" (`PAUSE_DEFAULT`, vLLM's): `ContinuousBatchingManager.pause(mode)`,
  `RolloutClient.pause(mode)`, the server's `POST /pause?mode=`.
- weight update, default "wait" (`UPDATE_DEFAULT`: a batch in flight stays on one policy version):
  `RolloutEngine.update_weights(in_flight=)`, `RolloutPool.update_weights(in_flight=)`,
  `RolloutClient.update_weights(in_flight=)`, `WeightBroadcaster.broadcast(in_flight=)`, the server's
  `?in_flight=` on `/finish_weight_update` and `/update_weights_from_disk`. A server paused with "keep"
  applies any update with its frozen requests kept (they cannot finish while frozen).

Pure Python: no torch.
"""

from __future__ import annotations

from typing import Literal, get_args

InFlight = Literal["abort", "wait", "keep"]
IN_FLIGHT_MODES: tuple[str, ...] = get_args(InFlight)
PAUSE_DEFAULT: InFlight = "abort"
UPDATE_DEFAULT: InFlight = "wait"

_RENAMED = {"finish": "wait"}  # NOTE: the engine's old spelling; named in the error, never accepted


def check_mode(mode: object, field: str) -> InFlight:
    """`mode` if it is one of `IN_FLIGHT_MODES`, else a ValueError naming `field` and the accepted modes."""
    if mode in IN_FLIGHT_MODES:
        return mode  # type: ignore[return-value]
    hint = f" ({mode!r} is now {_RENAMED[mode]!r})" if isinstance(mode, str) and mode in _RENAMED else ""
    raise ValueError(
        f"{field} must be one of {', '.join(repr(m) for m in IN_FLIGHT_MODES)}{hint}, got {mode!r}"
    )


def check_recompute_kv(in_flight: InFlight, recompute_kv: bool) -> None:
    """`recompute_kv=True` redoes the KV of requests kept in flight: refused, by name, with any other mode."""
    if recompute_kv and in_flight != "keep":
        raise ValueError("recompute_kv=True applies to requests kept in flight: pass in_flight='keep'")


def check_remote_update(recompute_kv: bool, version: int | None, who: str) -> None:
    """A remote rollout (a pool or client of servers) takes `update_weights`' full signature but cannot yet ask a
    server to recompute KV or to take a given version: a ValueError naming the argument instead of ignoring it."""
    if recompute_kv:
        raise ValueError(f"{who}.update_weights: recompute_kv=True is not supported through a server yet")
    if version is not None:
        raise ValueError(f"{who}.update_weights: version= is not supported through a server (it counts its own)")
