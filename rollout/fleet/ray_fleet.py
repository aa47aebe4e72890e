"""`RolloutFleet`: rollout engines as Ray actors behind the `RolloutEngine` API (the `[ray]` extra).

    fleet = RolloutFleet("ckpt/", num_engines=2, engine_config=cbc, resources_per_engine={"CPU": 1})
    batch = fleet.generate(prompt_ids, temps=1.0, group_size=8, max_new_tokens=64, seed=0)   # a RolloutBatch
    fleet.update_weights(policy)        # one broadcast or one object-store copy; the version bumps everywhere
    fleet.close()                       # no actor, no placement group (and no local cluster it started) left

Placement: one `EngineWorker` actor per engine, each in its own bundle of one placement group
(`resources_per_engine`, strategy `placement_strategy`); joins the running cluster (`address`, or the one this
process is already connected to) or starts a local one on 127.0.0.1 sized for the engines.

Generation: a call's groups are cut into contiguous shards, one per engine, sized so the engines' groups in
flight (this call's and other threads') even out, least loaded first; a group never leaves its engine (its prompt
is prefilled once there). Shard groups are seeded as the call's groups they are (`prompt_index`,
`rollout.sampling.seeding`), so a seed gives the in-process engine's samples whatever the split.

Weights (`weight_transfer`): "object_store", one `ray.put` of the state dict that every engine reads; "collective",
a torch.distributed group formed once (learner rank 0, engine i rank i + 1; gloo on CPU, NCCL with GPU engines,
`rollout.fleet.weight_group`) and one bucketed broadcast per update; "auto" (default): collective (measured 2.7x
faster on CPU, docs/fleets.md), the object store when the group cannot be formed. A member failing an update
sends that update through the object store (one warning line); the group is formed again at the next one.

Failures: an actor that dies mid-call (killed, out of memory, node lost) is restarted by Ray (`max_restarts`); at
start it loads the fleet's current weights from the `WeightStore` (after a broadcast update: a copy from an engine
holding them) before serving, and its shards go to the least loaded engine, with one warning line. A shard past
`request_timeout_s` is a hung engine: the actor is killed (Ray restarts it) and the shard resubmitted. Each shard is
tried at most `max_attempts` times.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence

import torch

from rollout.api.batch import RolloutBatch, pack_batch
from rollout.api.score_batch import score_inputs
from rollout.fleet import weight_group
from rollout.fleet.engine_health import EngineHealth
from rollout.fleet.engine_worker import EngineWorker, WeightStore, to_payload, tokenizer_in
from rollout.fleet.sessions import SessionTable, check_session_ids, place_sessions
from rollout.fleet.shards import merge_scores
from rollout.in_flight import UPDATE_DEFAULT, InFlight, check_mode
from rollout.sampling_params import SamplingParams, per_prompt
from rollout.weights.checkpoint import load_checkpoint

logger = logging.getLogger("rollout.fleet")


def require_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("RolloutFleet needs Ray, the [ray] extra: pip install 'rollout[ray]'") from e
    return ray


class RolloutFleet:
    """Rollout engines as Ray actors, with the `RolloutEngine` API (see the module docstring).

    Args:
        model_or_dir: a `save_pretrained` directory (each engine loads it) or the policy module (put in the
            object store once).
        num_engines: engine actors to place.
        engine_config: each engine's `ContinuousBatchingConfig`; generation_config: its defaults.
        resources_per_engine: one engine's placement-group bundle, {"CPU": 1} (default) or {"GPU": 1, ...}.
        tensor_parallel_size: 1 (tensor-parallel engine groups are not supported by the fleet yet).
        tokenizer: encodes string prompts, decodes completions, gives the pad id (default: the directory's).
        dtype: cast the engines' copy ("bfloat16", ...). threads_per_engine: torch threads (default its CPUs).
        address: a Ray cluster to join ("auto", "ray://..."); None: the connected one, else a new local one.
        num_cpus: the local cluster's CPUs (default: the engines' CPUs).
        max_restarts: Ray restarts of each actor; max_attempts: tries of one shard.
        request_timeout_s: a shard's deadline; start_timeout_s: the deadline of placement and actor starts.
        weight_transfer: "auto", "collective" or "object_store" (the module docstring); bucket_bytes: the
            collective path's largest flat buffer; weight_group_timeout_s: the group's own timeout (joining it,
            each broadcast; waiting for the engines to drain their requests is bounded by request_timeout_s).
    """

    def __init__(self, model_or_dir, num_engines: int = 1, engine_config=None,
                 resources_per_engine: Mapping[str, float] | None = None, tensor_parallel_size: int = 1, *,
                 tokenizer=None, generation_config=None, dtype: str | None = None,
                 threads_per_engine: int | None = None, address: str | None = None, num_cpus: int | None = None,
                 max_restarts: int = 3, max_attempts: int = 3, request_timeout_s: float = 600.0,
                 start_timeout_s: float = 300.0, placement_strategy: str = "PACK", weight_transfer: str = "auto",
                 bucket_bytes: int = weight_group.DEFAULT_BUCKET_BYTES, weight_group_timeout_s: float = 120.0) -> None:
        ray = require_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be a positive int, got {num_engines!r}")
        if tensor_parallel_size != 1:
            raise NotImplementedError("tensor_parallel_size > 1: RolloutFleet places one single-device engine per "
                                      "actor for now (use rollout serve with --tensor-parallel-size for TP engines)")
        bundle = {k: float(v) for k, v in (resources_per_engine or {"CPU": 1}).items()}
        if not bundle or any(v < 0 for v in bundle.values()) or not any(v > 0 for v in bundle.values()):
            raise ValueError(f"resources_per_engine must ask for some resources, got {resources_per_engine!r}")
        self.weight_transfer, backend = weight_group.resolve_transfer(weight_transfer, bundle)
        if max_attempts < 1 or max_restarts < 0:
            raise ValueError(f"max_attempts must be >= 1 and max_restarts >= 0, got {max_attempts}, {max_restarts}")
        self.ray = ray
        self.started_ray = False
        if not ray.is_initialized():
            if address is None:
                cpus = num_cpus or int(sum(bundle.get("CPU", 0) for _ in range(num_engines))) or 1
                # NOTE: Ray runs workers at nice 15 by default; here the engines are the work
                ray.init(num_cpus=cpus, num_gpus=int(bundle.get("GPU", 0) * num_engines), include_dashboard=False,
                         _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
                         _system_config={"worker_niceness": 0})
            else:
                ray.init(address=address, logging_level=logging.WARNING)
            self.started_ray = True
        self.request_timeout_s, self.start_timeout_s, self.max_attempts = (
            request_timeout_s,
            start_timeout_s,
            max_attempts,
        )
        self.max_restarts = max_restarts
        self.tokenizer = tokenizer if tokenizer is not None else tokenizer_in(model_or_dir)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else _pad_of(model_or_dir, generation_config)
        self.device = torch.device("cpu")  # NOTE: batches are packed here; the trainer moves them
        self.closed = False
        self.policy_version = 0
        self.last_update_s, self.last_update_path = float("nan"), ""
        self.weight_group = weight_group.LearnerGroup(
            backend or "gloo", bucket_bytes, weight_group_timeout_s, request_timeout_s
        )
        self.group_address = ray.util.get_node_ip_address()  # NOTE: 127.0.0.1 on the local cluster
        self.pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy=placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=start_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"the Ray cluster has no room for {num_engines} engine(s) of {bundle} within "
                               f"{start_timeout_s:.0f} s (cluster resources: {ray.cluster_resources()})")
        # NOTE: named, and passed to the engines by name: an actor handle among an actor's constructor arguments makes
        # Ray log an error line ("constructor arguments in the object store") at every engine's start
        self.store_name = f"rollout-weight-store-{uuid.uuid4().hex}"
        self.store = ray.remote(num_cpus=0)(WeightStore).options(name=self.store_name).remote()
        source = str(model_or_dir) if isinstance(model_or_dir, (str, os.PathLike)) else model_or_dir
        # NOTE: the actors' constructor arguments, held here: Ray restarts an actor from them. A model object is put
        # once; the rest go inline (an object-store argument makes Ray log an error line at every actor's start)
        self.init_args = [source if isinstance(source, str) else ray.put(source), tokenizer, engine_config,
                          generation_config]
        threads = threads_per_engine or max(1, int(bundle.get("CPU", 1)))
        worker = ray.remote(EngineWorker)
        self.actors = [
            worker.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                max_restarts=max_restarts,
                max_task_retries=0,
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=k),
            ).remote(*self.init_args, self.store_name, threads, dtype, k)
            for k in range(num_engines)
        ]
        try:
            infos = ray.get([a.ready.remote() for a in self.actors], timeout=start_timeout_s)
        except Exception:
            self.close()
            raise
        self.health = EngineHealth(ray, self.actors, infos, max_restarts, start_timeout_s, self.store)
        self.sessions = SessionTable()  # NOTE: session id -> its engine (`rollout.fleet.sessions`)
        if self.weight_transfer == "collective":
            try:
                self.weight_group.form(ray, list(enumerate(self.actors)), self.group_address)
            except Exception as err:
                if weight_transfer != "auto":
                    self.close()
                    raise
                self.weight_transfer = "object_store"  # NOTE: e.g. NCCL with the learner on an engine's GPU
                logger.warning("rollout fleet: no weight group (%s: %s), updates go through the object store",
                               type(err).__name__, err)
        logger.info("rollout fleet: %d engine(s) of %s up (pids %s)", num_engines, bundle, self.pids)

    # ------------------------------------------------------------------------ properties
    @property
    def num_engines(self) -> int:
        return len(self.actors)

    @property
    def pids(self) -> list[int]:
        """The engine actors' process ids (as of their last start)."""
        return [i["pid"] for i in self.health.infos]

    @property
    def load(self) -> list[int]:
        """Groups (or scored rows) in flight on each engine."""
        return self.health.load

    @property
    def restarts(self) -> int:
        """Engine failures seen (each actor restarted by Ray, up to `max_restarts`)."""
        return self.health.restarts

    @property
    def resubmitted(self) -> int:
        """Shards sent again after their engine died or hung."""
        return self.health.resubmitted

    # ---------------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], temps: float | Sequence[float] | None = None,
                 group_size: int = 1, max_new_tokens: int | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, *,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 return_routed_experts: bool = False, session_ids=None) -> RolloutBatch:
        """`group_size` samples per prompt over the engines; a `RolloutBatch` on the CPU, rows grouped by prompt
        in the call's order (the arguments are `RolloutEngine.generate`'s: `sampling` one `SamplingParams` or one
        per prompt, the keywords setting the same fields). `session_ids` (one per prompt, or None): a prompt's group
        runs on the engine its session's earlier groups ran on (`rollout.fleet.sessions`), until `finish_session`."""
        self._check_open()
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if return_routed_experts:
            raise ValueError("RolloutFleet.generate does not return routed experts yet: generate on a RolloutEngine")
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of prompts, got a single string")
        ids = [self._encode(p) for p in prompts]
        each = per_prompt(sampling, len(ids), temps=temps, top_k=top_k, top_p=top_p, seed=seed,
                          max_new_tokens=max_new_tokens)  # NOTE: refused here, before anything is sent
        sessions = None if session_ids is None else check_session_ids(session_ids, len(ids))

        def call(actor, start: int, end: int):
            return actor.generate.remote(ids[start:end], each[start:end], group_size, start)

        parts = self._run(call, len(ids), "group", None if sessions is None else self._session_shards(sessions))
        outputs = [o for part in parts for o in part]
        top_logprobs = max((s.logprobs for s in each), default=0)
        return pack_batch(ids, outputs, [s.temperature for s in each], group_size, self.pad_token_id,
                          self.policy_version, self.device, self.tokenizer, top_logprobs)

    def score(self, prompt_ids, completion_ids=None, top_logprobs: int = 0, prompt_logprobs: bool = False,
              temps: float | Sequence[float] | None = None, progress: bool = False, *,
              sampling: SamplingParams | Sequence[SamplingParams] | None = None,
              return_routed_experts: bool = False):
        """`RolloutEngine.score` over the engines (rows cut into contiguous shards); a `ScoreBatch` on the CPU."""
        self._check_open()
        if return_routed_experts:
            raise ValueError("RolloutFleet.score does not return routed experts: score on a RolloutEngine")
        prompts, completions, rows, width = score_inputs(prompt_ids, completion_ids, temps, self._encode,
                                                         lambda c: self._encode(c, special=False), sampling)

        def call(actor, start: int, end: int):  # NOTE: each row's SamplingParams carries its temperature
            args = {"top_logprobs": top_logprobs, "prompt_logprobs": prompt_logprobs, "sampling": rows[start:end]}
            return actor.score.remote(prompts[start:end], completions[start:end], args)

        parts = self._run(call, len(prompts), "row")
        return merge_scores(parts, prompts, completions, width)

    def _encode(self, prompt, special: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer= to RolloutFleet")
            return list(self.tokenizer(prompt, add_special_tokens=special)["input_ids"])
        return [int(t) for t in prompt]

    def _session_shards(self, sessions: list[str | None]) -> list[tuple[int, int, int]]:
        """One shard per group, on its session's engine (or the least loaded), counted in flight."""
        health = self.health
        serving = health.serving()
        with health.lock:
            engines = place_sessions(sessions, self.sessions, dict(enumerate(health.load)), serving)
            for k in engines:
                health.load[k] += 1
        return [(k, i, i + 1) for i, k in enumerate(engines)]

    def finish_session(self, session_id: str) -> None:
        """Forget `session_id`'s engine: its next group goes to the least loaded one."""
        self.sessions.finish(session_id)

    def _run(self, call, n: int, unit: str, shards: list[tuple[int, int, int]] | None = None) -> list:
        """Run `call(actor, start, end)` over contiguous shards of `n` items (`shards`, already counted in flight,
        or least loaded first); resubmit the shards of an engine that dies or passes its deadline. Returns the
        shards' results in order."""
        ray, health = self.ray, self.health
        shards = health.reserve(n) if shards is None else shards
        pending = {call(self.actors[k], s, e): (k, s, e, 1, time.monotonic()) for k, s, e in shards}
        results: dict[int, object] = {}
        try:
            while pending:
                deadline = min(t for *_, t in pending.values()) + self.request_timeout_s
                done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not done:  # NOTE: the oldest shard passed its deadline: its engine hangs
                    ref = min(pending, key=lambda r: pending[r][4])
                    k, s, e, attempt, _ = pending.pop(ref)
                    health.failed(k, f"no answer within {self.request_timeout_s:.0f} s", e - s, unit, kill=True)
                    pending.update(self._resubmit(call, k, s, e, attempt))
                    continue
                k, s, e, attempt, _ = pending.pop(done[0])
                try:
                    results[s] = ray.get(done[0])
                except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as err:
                    health.failed(k, type(err).__name__, e - s, unit)
                    pending.update(self._resubmit(call, k, s, e, attempt))
                    continue
                health.done(k, e - s)
        except BaseException:
            for k, s, e, *_ in pending.values():
                health.done(k, e - s)
            raise
        return [results[s] for s in sorted(results)]

    def _resubmit(self, call, k: int, s: int, e: int, attempt: int) -> dict:
        if attempt >= self.max_attempts:
            raise RuntimeError(f"{e - s} item(s) [{s}, {e}) failed on {attempt} attempt(s) (last on engine {k})")
        target = self.health.take_over(k, e - s)
        return {call(self.actors[target], s, e): (target, s, e, attempt + 1, time.monotonic())}

    # ------------------------------------------------------------------------- weights
    def update_weights(self, source, in_flight: InFlight = UPDATE_DEFAULT, recompute_kv: bool = False, *,
                       version: int | None = None) -> int:
        """New weights on every engine; returns the new `policy_version`, the same on every engine. `in_flight` as
        `RolloutEngine.update_weights` ("keep": running groups go on under the new weights, KV kept). The path is
        `weight_transfer`'s: one broadcast over the weight group, or one object-store copy read by each engine
        (also the collective path's fallback, for an update a member fails; `last_update_path` says which)."""
        self._check_open()
        check_mode(in_flight, "in_flight")
        if recompute_kv:
            raise ValueError("RolloutFleet.update_weights: recompute_kv=True is not supported on a fleet yet")
        if isinstance(source, (str, os.PathLike)):
            source = load_checkpoint(source)
        start, version = time.perf_counter(), self.policy_version + 1 if version is None else int(version)
        path = "object_store"
        if self.weight_transfer == "collective":
            path = weight_group.collective_update(self, source, version, in_flight)
        if path == "object_store":
            self._through_store(source, version, in_flight)
        self.policy_version = version
        self.last_update_s, self.last_update_path = time.perf_counter() - start, path
        logger.info("weights v%d on %d engine(s) in %.2fs (%s)", version, len(self.health.alive()),
                    self.last_update_s, path)
        return version

    def _through_store(self, source, version: int, in_flight: str) -> None:
        """One object-store copy of the state dict, read by each engine (and by a replacement at its start)."""
        ray, health = self.ray, self.health
        ref = ray.put(to_payload(weight_group.state_dict_of(source)))
        ray.get(self.store.set.remote([ref], version), timeout=self.start_timeout_s)  # NOTE: before any engine
        health.current = (ref, version)  # NOTE: a recovering engine gets it when its probe answers
        health.poll()
        with health.lock:
            targets = [k for k in health.alive() if k not in health.recovering]
        refs = {self.actors[k].update_weights.remote(ref, version, in_flight): k for k in targets}
        self._collect(refs, version)

    def _collect(self, refs: dict, version: int) -> None:
        """Wait for the engines' update calls (`refs`: ref -> engine); a dead or late engine is failed (Ray
        restarts it; it gets `health.current`), a wrong version raises."""
        ray, health = self.ray, self.health
        done, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.request_timeout_s)
        for r in late:
            health.failed(refs[r], f"weight update not done within {self.request_timeout_s:.0f} s", 0, "group",
                          kill=True)
        for r in done:
            try:
                got = ray.get(r)
            except ray.exceptions.RayActorError as err:  # NOTE: its replacement loads `version` from the store
                health.failed(refs[r], f"{type(err).__name__} during a weight update", 0, "group")
                continue
            if got != version:
                raise RuntimeError(f"engine {refs[r]} reports version {got} after update {version}")

    def engine_versions(self) -> list[int]:
        """Each live engine's weight version, asked of the actors (waiting for the recovering ones)."""
        return [i["version"] for i in self.health.wait_all()]

    # ---------------------------------------------------------------- memory, closing
    def sleep(self) -> int:
        self._check_open()
        return sum(self.ray.get([self.actors[k].sleep.remote() for k in self.health.serving()]))

    def wake(self) -> int:
        self._check_open()
        return sum(self.ray.get([self.actors[k].wake.remote() for k in self.health.serving()]))

    def close(self, timeout_s: float = 30.0) -> None:
        """Kill every engine actor and the weight store, remove the placement group, and stop the local cluster
        when this fleet started it; waits (up to `timeout_s`) for this machine's engine processes to exit."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        infos = self.health.infos if hasattr(self, "health") else []
        pids = [i["pid"] for i in infos if i.get("host") == socket.gethostname()]
        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
        if hasattr(self, "weight_group"):
            self.weight_group.close()
        if hasattr(self, "store"):
            ray.kill(self.store, no_restart=True)
        ray.util.remove_placement_group(self.pg)
        deadline = time.monotonic() + timeout_s
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.started_ray:
            ray.shutdown()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this RolloutFleet is closed")

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pad_of(source, generation_config) -> int:
    for gc in (generation_config, getattr(source, "generation_config", None)):
        for field in ("pad_token_id", "eos_token_id"):
            value = getattr(gc, field, None)
            value = value[0] if isinstance(value, (list, tuple)) and value else value
            if isinstance(value, int):
                return value
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
