"""rollout as a verl 0.9 rollout backend (rollout name `"rollout"`), the way verl takes an external engine: a
module verl imports in every process (`VERL_USE_EXTERNAL_MODULES=rollout.integrations.verl`, or this package's
`verl.plugins` entry point, which verl loads on import) that registers

- `EngineReplica` in `RolloutReplicaRegistry` under `"rollout"`: a verl `RolloutReplica` whose
  `launch_servers()` starts one Ray actor, `RolloutServer`, holding a `RolloutEngine` over
  `model_config.local_path`; `init_standalone()` on a cluster without GPUs starts it on CPU (verl's own
  standalone path asks for GPU workers);
- `ServerAdapter` in verl's rollout registry (`("rollout", "async")`): the `BaseRollout` verl's checkpoint
  engine builds in trainer processes; `update_weights` sends verl's `(name, tensor)` stream to the server
  actor, which loads it through `RolloutEngine.update_weights` (names checked, all or nothing, the requests in
  flight finished first); `resume` / `release` wake and sleep the engine.

`RolloutServer.generate(prompt_ids, sampling_params, request_id, ...)` returns verl's `TokenOutput`:
`token_ids`, `log_probs` (when `sampling_params["logprobs"]`), `routed_experts` (an MoE policy: `[prompt +
completion, L, k]`), `stop_reason` ("completed" or "aborted"), and in `extra_fields` the engine's per-token
policy versions (`weight_versions`) and verl's `global_steps` of the last update. `sampling_params` carries
vLLM's names (what verl's agent loops send) and becomes one `rollout.SamplingParams`; with no `max_tokens` the
budget is the config's `prompt_length + response_length - len(prompt_ids)`, within `max_model_len`, as verl's
own servers do. Besides: `wake_up`, `sleep`, `abort_all_requests` (the requests in flight end now, stop reason
"aborted"; new ones wait for `resume_generation`), `clear_kv_cache`, `release_kv_cache` / `resume_kv_cache`.

Settings (verl's config): `actor_rollout_ref.rollout.name=rollout`, `mode=async`, `dtype` (the engine's;
verl's default is bfloat16); `load_format` is ignored (the engine loads `model_config.local_path`).
`tests/integrations/test_verl.py` drives it with verl's own `LLMServerClient` and `SingleTurnAgentLoop` on a
local Ray cluster."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray
import torch
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from rollout.api.engine import RolloutEngine
from rollout.config import ContinuousBatchingConfig
from rollout.sampling_params import SamplingParams

logger = logging.getLogger("rollout")

NAME = "rollout"
# verl sampling keys that carry no sampler setting here
CONTROL_KEYS = (
    "logprobs",
    "do_sample",
    "max_new_tokens",
    "n",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "output_kind",
)


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica `replica_rank`'s server (how a `ServerAdapter` finds it)."""
    return f"rollout_server_{replica_rank}"


class RolloutServer:
    """One `RolloutEngine` behind verl's server-actor methods (run as a Ray actor by `EngineReplica`).

    Args:
        config: verl's `RolloutConfig`; model_config: its `HFModelConfig` (`local_path` is loaded).
        replica_rank: this replica's rank; rollout_mode: verl's `RolloutMode` (sleep / wake only outside
            standalone mode, as verl's servers).
        engine_config: the engine's `ContinuousBatchingConfig` (None: defaults).
    """

    def __init__(
        self,
        config,
        model_config,
        replica_rank: int,
        rollout_mode: RolloutMode,
        engine_config: ContinuousBatchingConfig | None = None,
    ) -> None:
        self.config, self.model_config = config, model_config
        self.replica_rank, self.rollout_mode = replica_rank, rollout_mode
        self.engine_config = engine_config
        self.engine: RolloutEngine | None = None
        self.global_steps: int | None = None
        self.max_model_len: int | None = None

    async def launch_server(self) -> tuple[str, int]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.model_config.local_path
        dtype = getattr(self.config, "dtype", None) or "float32"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype) if dtype != "auto" else dtype
        )
        model.to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        self.engine = RolloutEngine(model, tokenizer=tokenizer, config=self.engine_config)
        limits = [
            x
            for x in (self.config.max_model_len, getattr(model.config, "max_position_embeddings", None))
            if x
        ]
        self.max_model_len = min(limits) if limits else None
        # NOTE: a synthetic port (the replica rank), as verl's in-process servers do: its load balancer keys
        # servers by "address:port"; generation goes through this actor, not HTTP
        return ray.util.get_node_ip_address().strip("[]"), self.replica_rank

    def _sampling(self, params: dict[str, Any], prompt_len: int) -> tuple[SamplingParams, bool]:
        params = dict(params or {})
        logprobs = bool(params.get("logprobs", False))
        if params.get("do_sample", True) is False:
            params["temperature"] = 0.0
        max_tokens = params.pop("max_tokens", None) or params.get("max_new_tokens")
        if max_tokens is None:
            max_tokens = self.config.prompt_length + self.config.response_length - prompt_len
        if self.max_model_len is not None:
            max_tokens = min(max_tokens, self.max_model_len - prompt_len)
        if max_tokens < 1:
            raise ValueError(
                f"prompt_ids has {prompt_len} tokens: no room to generate (max_model_len "
                f"{self.max_model_len}, prompt_length + response_length "
                f"{self.config.prompt_length + self.config.response_length})"
            )
        fields = {k: v for k, v in params.items() if k not in CONTROL_KEYS}
        if fields.get("top_k") == -1:
            fields["top_k"] = 0  # NOTE: vLLM's "off"
        try:
            return SamplingParams(max_tokens=int(max_tokens), **fields), logprobs
        except TypeError as e:
            raise ValueError(f"sampling_params: {e}") from None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data=None,
        video_data=None,
        priority: int = 0,
        **_: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None:
            raise ValueError(
                "the rollout engine serves text models: image_data / video_data are not supported"
            )
        sp, logprobs = self._sampling(sampling_params, len(prompt_ids))
        routes = bool(getattr(self.config, "enable_rollout_routing_replay", False))
        batch = await asyncio.to_thread(
            self.engine.generate, [list(prompt_ids)], sampling=sp, group_size=1, return_routed_experts=routes
        )
        n = int(batch.completion_mask[0].sum())
        tokens = batch.completion_ids[0][:n].tolist()
        reason = batch.finish_reasons[0]
        versions = batch.versions[0][:n].tolist() if batch.versions is not None else []
        experts = None
        if batch.routed_experts is not None:
            width = int(batch.prompt_mask[0].sum())
            start = batch.prompt_ids.shape[1] - width  # NOTE: prompts are left-padded in the batch
            experts = batch.routed_experts[0][start : start + width + n].cpu().numpy()
        return TokenOutput(
            token_ids=tokens,
            log_probs=batch.logprobs[0][:n].tolist() if logprobs else None,
            routed_experts=experts,
            stop_reason="aborted" if reason in ("cancelled", "abort") else "completed",
            num_preempted=None,
            extra_fields={"global_steps": self.global_steps, "weight_versions": versions},
        )

    async def update_weights(self, named_tensors: list, global_steps: int | None = None) -> int:
        """Load `named_tensors` ([(name, tensor)]) into the engine; returns the new policy version."""
        version = await asyncio.to_thread(self.engine.update_weights, named_tensors)
        self.global_steps = global_steps
        return version

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.rollout_mode != RolloutMode.STANDALONE and self.engine.is_asleep:
            await asyncio.to_thread(self.engine.wake)

    async def sleep(self) -> None:
        if self.rollout_mode != RolloutMode.STANDALONE and self.config.free_cache_engine:
            await asyncio.to_thread(self.engine.sleep)

    async def release_kv_cache(self) -> None:
        await asyncio.to_thread(self.engine.sleep)

    async def resume_kv_cache(self) -> None:
        if self.engine.is_asleep:
            await asyncio.to_thread(self.engine.wake)

    async def clear_kv_cache(self) -> None:
        await asyncio.to_thread(self.engine.manager.reset_prefix_cache)

    async def abort_all_requests(
        self, reset_prefix_cache: bool = False, reject_request: bool = False
    ) -> dict:
        """The requests in flight end now (their tokens so far, stop reason "aborted"); requests sent before
        `resume_generation` wait for it (`reject_request` is not supported: they are held, not failed)."""
        if reject_request:
            raise NotImplementedError(
                "the rollout engine holds requests sent while aborted until "
                "resume_generation; it cannot reject them"
            )
        await asyncio.to_thread(self.engine.manager.pause, "abort")
        if reset_prefix_cache:
            await asyncio.to_thread(self.engine.manager.reset_prefix_cache)
        return {"aborted_count": None, "request_ids": []}

    async def resume_generation(self) -> None:
        await asyncio.to_thread(self.engine.manager.resume)

    async def start_profile(self, **_: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    def policy_version(self) -> int:
        return self.engine.policy_version


class EngineReplica(RolloutReplica):
    """verl's `RolloutReplica` over one `RolloutServer` actor."""

    def rollout_worker_use_gpu(self) -> bool:
        return torch.cuda.is_available()

    async def init_standalone(self):
        if ray.cluster_resources().get("GPU", 0) > 0:
            return await super().init_standalone()
        self.rollout_mode = RolloutMode.STANDALONE  # NOTE: CPU: verl's standalone path asks for GPU workers
        await self.launch_servers()

    async def launch_servers(self):
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        actor = (
            ray.remote(RolloutServer)
            .options(
                name=server_name(self.replica_rank),
                num_cpus=1,
                num_gpus=gpus,
                max_concurrency=self.max_concurrency,
            )
            .remote(
                self.config, self.model_config, self.replica_rank, self.rollout_mode or RolloutMode.STANDALONE
            )
        )
        host, port = await actor.launch_server.remote()
        self.servers = [actor]
        self._server_handle = actor
        self._server_address = f"{host}:{port}"


class ServerAdapter(BaseRollout):
    """verl's `BaseRollout` in a trainer process: weights and memory of replica `RANK // world`'s server."""

    def __init__(self, config, model_config, device_mesh=None, *args, **kwargs) -> None:
        super().__init__(config, model_config, device_mesh)
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank, self.rollout_rank = rank // world, rank % world
        self.is_leader_rank = self.rollout_rank == 0
        self._server = None

    def server(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if self.config.free_cache_engine and self.is_leader_rank:
            await self.server().wake_up.remote(tags=tags)

    async def release(self):
        if self.config.free_cache_engine and self.is_leader_rank:
            await self.server().sleep.remote()

    async def update_weights(
        self, weights, wire_format: str = "named_tensors", global_steps: int | None = None, **kwargs
    ):
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"wire_format {wire_format!r}: the rollout engine takes full tensors "
                "('named_tensors'; checkpoint_engine.backend other than delta)"
            )
        pairs = [(name, t.detach().to("cpu").contiguous()) for name, t in weights]
        if self.is_leader_rank:
            return await self.server().update_weights.remote(pairs, global_steps)
        return None


def register() -> None:
    """Register `EngineReplica` and `ServerAdapter` with verl under the rollout name "rollout" (on import)."""
    RolloutReplicaRegistry.register(NAME, lambda: EngineReplica)
    _ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.ServerAdapter"


register()
