"""`rollout serve` on a tensor-parallel model (`--tensor-parallel-size N` under `torchrun --nproc-per-node N`).

Rank 0 serves HTTP; every other rank builds the same engine and follows rank 0's rounds (`rollout.engine.tp`) until
rank 0's engine stops (its close ends the followers' engine threads). The followers replay rank 0's prefix
flushes (`/reset_prefix_cache`, `/sleep`: the followers keep their KV memory while rank 0 sleeps). Weight
updates would change rank 0's shards alone, so those routes answer 400 under tensor parallelism until the
weights are sent to every rank.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from rollout.serve.protocol import error_body

RANK0_ONLY_ROUTES = frozenset({
    "/update_weights_from_disk", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
    "/finish_weight_update",
})


def follow(engine) -> None:
    """A rank other than 0: step rank 0's rounds on the engine's thread until rank 0 stops, then close."""
    engine.tensor_parallel.replay_flushes = True
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
                       "rank 0's weight shards without the other ranks'")
            return JSONResponse(error_body(message, None, 400), status_code=400)
        return await call_next(request)
