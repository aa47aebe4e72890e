"""What `EngineCore` does for `return_routed_experts=True`: refuse it where routes cannot be recorded (by name),
give an asking request its route store, and turn recording on at the first such request.

The recording itself is `rollout.model.routes`; the routers are `rollout.model.routers`.
"""

from __future__ import annotations

from rollout.model.routers import route_shape
from rollout.model.routes import RequestRoutes, RoutedOffloader, RouteRecorder


def request_routes(core, capacity: int) -> RequestRoutes:
    """The route store of a new request of `capacity` tokens; ValueError naming `return_routed_experts` where the
    engine cannot record them."""
    check_routes(core)
    return RequestRoutes(capacity, *route_shape(core.routers))


def check_routes(core) -> None:
    """ValueError naming `return_routed_experts` where this engine cannot record routes (a dense model, tensor
    parallelism, the compiled forward); `rollout serve --enable-return-routed-experts` asks it at start-up."""
    name = type(core.model).__name__
    if not core.routers:
        raise ValueError(f"return_routed_experts=True: {name} has no mixture-of-experts router (a dense model)")
    if core.tp is not None:
        raise ValueError(
            "return_routed_experts=True is not supported under tensor parallelism yet: each rank runs the routers "
            "on its own and no step gathers their routes to rank 0"
        )
    if core.runner.forward is not core.runner.model:
        raise ValueError(
            "return_routed_experts=True needs the eager forward: the compiled one (default_compile_level >= 1) "
            "does not run the routers' hooks; set default_compile_level=0"
        )


def start_recording(core) -> None:
    """From now on every step records its routes (once per engine): every page cached later has its routes, so the
    prefix cache is dropped now, and preempted requests park their pages' routes with their KV."""
    if core.runner.routes is not None:
        return
    recorder = RouteRecorder(core.routers, core.cache.num_slots, core.page_size, core.device)
    core.runner.routes = recorder
    if core.scheduler.offloader is not None:
        core.scheduler.offloader = RoutedOffloader(core.scheduler.offloader, recorder)
    core.reset_prefix_cache()
