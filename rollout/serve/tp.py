"""`rollout serve` on a tensor-parallel model (`--tensor-parallel-size N` under `torchrun --nproc-per-node N`).

Rank 0 serves HTTP; every other rank builds the same engine and follows rank 0's rounds (`rollout.engine.tp`) until
rank 0's engine stops (its close ends the followers' engine threads). The followers replay rank 0's prefix
flushes (`/reset_prefix_cache`, `/sleep`: the followers keep their KV memory while rank 0 sleeps) and its
checkpoint loads (`/update_weights_from_disk`: rank 0 records the path with the version it becomes, and each
follower loads the same checkpoint into its own shards before the first round at that version). The routes
that push tensors to rank 0 would change its shards alone, so they answer 400 under tensor parallelism.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from rollout.serve.protocol import error_body
from rollout.serve.weights import load_checkpoint

RANK0_ONLY_ROUTES = frozenset({
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
})


def follow(engine) -> None:
    """A rank other than 0: step rank 0's rounds on the engine's thread until rank 0 stops, then close."""
    engine.tensor_parallel.replay_flushes = True
    engine.tensor_parallel.replay_loads = load_checkpoint
    try:
        thread = engine.manager.thread
        if thread is not None:
            thread.join()
    finally:
        engine.close()


def refuse_rank0_only_routes(app) -> None:
    """Answer 400 on the routes that would change rank 0's weights alone."""

    @app.middleware("http")
    async def tp_guard(request, call_next):
        if request.url.path in RANK0_ONLY_ROUTES:
            message = (f"{request.url.path} is not supported with --tensor-parallel-size > 1 yet: it would change "
                       "rank 0's weight shards without the other ranks' (use /update_weights_from_disk)")
            return JSONResponse(error_body(message, None, 400), status_code=400)
        return await call_next(request)
