"""`EngineCore`: schedule -> run -> sample -> update, one step at a time, single-threaded.

The manager drives it, one `round()` at a time: from the thread that waits on results (`rollout.engine.collect`:
`RolloutEngine.generate`, `generate_batch`), else from its background thread (`rollout.engine.engine_thread`).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from rollout.attention.backends import create as create_backend
from rollout.attention.backends import select as select_backend
from rollout.config import ContinuousBatchingConfig
from rollout.engine.async_steps import AsyncSteps
from rollout.engine.cache_plan import engine_cache_stats, plan_engine_cache
from rollout.engine.heap import frozen_heap
from rollout.engine.routed_experts import request_routes, start_recording
from rollout.engine.speculation import Speculator
from rollout.engine.tp import AgreedSampler, TensorParallelGroup, tp_size_of
from rollout.invariant import mode as batch_invariant
from rollout.kernels import cpu_kernels
from rollout.kernels.linear import onednn_routed
from rollout.kv.kv_cache import PagedKVCache
from rollout.kv.offload import CpuOffloadBuffer
from rollout.kv.page_pool import PagePool
from rollout.model.engine_view import drop_weight_copies, make_engine_view
from rollout.model.lora import EngineLoras, strip_peft_layers
from rollout.model.model_facts import (
    eos_ids_of,
    has_attention_sinks,
    layer_groups,
    layer_windows,
    text_config,
)
from rollout.model.routers import moe_routers
from rollout.model.runner import ModelRunner
from rollout.model.static_decode import static_plan, varlen_compile
from rollout.prompts import check_token_ids, int_set
from rollout.requests import Request, RequestStatus
from rollout.sampling.sampler import Sampler, resolve_seed_stream
from rollout.sampling.sampling_fields import bind, generation_defaults
from rollout.sampling.token_logprobs import check_scoring, record_scores
from rollout.sampling_params import SamplingParams
from rollout.scheduling.scheduler import Scheduler
from rollout.scheduling.stages import SchedulerOutput
from rollout.weights.in_place import copy_weights, versioned_tensors, weights_version
from rollout.weights.lora_adapters import active_adapter, read_adapter

logger = logging.getLogger("rollout")

STAT_COUNTERS = (
    "computed_prompt_tokens",
    "generated_tokens",
    "recomputed_tokens",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


class EngineCore:
    """Owns the cache, the scheduler, the runner and the sampler of one model.

    Args:
        model: any HF causal LM (its parameters are shared, never copied).
        generation_config: defaults for max_new_tokens, eos, do_sample / temperature / top_k / top_p.
        config: the engine configuration.
    """

    def __init__(self, model: torch.nn.Module, generation_config: GenerationConfig | None = None,
                 config: ContinuousBatchingConfig | None = None) -> None:
        self.config = config = config or ContinuousBatchingConfig()
        self._model_ref = weakref.ref(model)  # NOTE: weak: a persistent manager must not keep its model alive
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config.log_unavailable_features(torch.cuda.is_available())
        if config.default_compile_level and self.device.type != "cpu":
            logger.warning("default_compile_level=%d has no effect on %s: rollout compiles its forward on a CPU only",
                           config.default_compile_level, self.device)
        self.view = make_engine_view(model)
        self.routers = moe_routers(self.view)  # NOTE: the view's MoE routers, in layer order (rollout.model.routers)
        self.windows, groups = layer_groups(layer_windows(model))
        sharing = config.allow_block_sharing
        # NOTE: the k-th layer of every group shares a storage, so a page costs max-group-size layers.
        invariant_kernels = batch_invariant.kernels_for(self.device, config.attn_backend)
        if config.batch_invariant:  # NOTE: one reduction order per token (rollout.invariant.mode); before any group
            batch_invariant.check(self.device, self.dtype, has_attention_sinks(model), type(model).__name__,
                                  tp_size_of(model), moe=bool(self.routers), kernels=invariant_kernels)
        # NOTE: under tensor parallelism each rank holds its own KV heads only (rollout.engine.tp)
        self.tp = TensorParallelGroup(model, config) if tp_size_of(model) > 1 else None
        # NOTE: a follower's own submissions only say which of rank 0's results it waits for (rollout.engine.tp)
        self.follower = self.tp is not None and not self.tp.leader
        attn_name = select_backend(config.attn_backend, self.device, self.dtype, has_attention_sinks(model),
                                   type(model).__name__)
        if config.batch_invariant:
            batch_invariant.install(self.view, invariant_kernels)
        plan = plan_engine_cache(model, config, self.device, self.dtype, groups, attn_name, self.tp)
        num_pages, self.max_batch_tokens, offload_pages = plan.num_pages, plan.max_batch_tokens, plan.offload_pages
        self.page_size = config.page_size
        self.backend = (batch_invariant.engine_backend(attn_name, invariant_kernels) if config.batch_invariant
                        else create_backend(attn_name, self.device, self.dtype, page_size=config.page_size,
                                            num_pages=num_pages, max_batch_tokens=self.max_batch_tokens))
        tc = text_config(model)
        static = static_plan(config, self.device, config.page_size, num_pages,
                             getattr(tc, "max_position_embeddings", None))
        if static is not None and not hasattr(self.backend, "static_group"):
            logger.warning("attn_backend %r has no in-place decode kernel: decode steps are not static "
                           "(decode_compile_config / use_cuda_graph need 'cpu' or 'triton')", self.backend.name)
            static = None
        # NOTE: a static decode step's padded rows write into one null page past the pool's
        self.cache = PagedKVCache(num_pages + (static is not None), config.page_size, self.device, self.dtype, groups,
                                  zeroed=self.backend.reads_unwritten_slots)
        if offload_pages:
            self.cache.offload = CpuOffloadBuffer(self.cache, offload_pages)
        self.page_pool = PagePool(num_pages, config.page_size, enable_prefix_caching=sharing)
        self.scheduler = Scheduler(
            self.page_pool, self.max_batch_tokens, config.max_requests_per_batch,
            config.scheduler_type, config.safety_margin, fork_prompts=config.allow_block_sharing,
            windows=self.windows, offloader=self.cache.offload,
        )
        self.runner = ModelRunner(self.view, self.cache, self.windows, backend=self.backend,
                                  compiled=varlen_compile(config, self.device), static=static)
        sampler = Sampler(self.device, seed_stream=resolve_seed_stream(config.seed_stream, self.device),
                          exact_logprobs=config.batch_invariant)
        self.sampler = sampler if self.tp is None else AgreedSampler(sampler, self.tp)
        self.set_generation_config(generation_config)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_context = getattr(tc, "max_position_embeddings", None)
        self.policy_version = 0
        self.requests: dict[str, Request] = {}  # live (not final) requests by id
        self.stats = dict.fromkeys(STAT_COUNTERS, 0)
        self._arrival = itertools.count()
        self.batch_ids = itertools.count()  # NOTE: ids of `add_requests` batches under tensor parallelism
        self._weights = versioned_tensors(self.view)
        self._weights_seen = weights_version(self._weights)
        # NOTE: n-gram speculation (rollout.engine.speculation); not across tensor-parallel ranks nor batch-invariant
        self.speculator = None if self.tp is not None or config.batch_invariant else Speculator(self, self._finalize)
        # NOTE: use_async_batching on CUDA (rollout.engine.async_steps); not under TP, nor speculating
        self.pipeline = None
        if (
            config.use_async_batching
            and self.device.type == "cuda"
            and self.tp is None
            and not config.speculative_method
        ):
            self.enable_async()
        logger.info(
            "rollout engine: %d pages of %d tokens (%.1f MiB KV), max_batch_tokens=%d, prefix caching %s, "
            "attention windows %s, CPU offload %d pages",
            num_pages, config.page_size, num_pages * config.page_size * plan.shape.bytes_per_token / 2**20,
            self.max_batch_tokens, "on" if sharing else "off", self.windows, offload_pages,
        )
        # NOTE: once per process and path: which attention runs and whether rollout's C++ kernels do (`rollout doctor`)
        cpu_kernels.announce(cpu_kernels.status_line(self.backend.name, self.device,
                                                       onednn_routed(self.view)))

    @property
    def model(self) -> torch.nn.Module:
        """The model served; its engine view (same class, config and parameters) once the caller dropped it."""
        return self._model_ref() or self.view

    # ------------------------------------------------------------ requests
    def set_generation_config(self, gc: GenerationConfig | None) -> None:
        """Defaults for new requests (a later call's config is honoured, never frozen at the first)."""
        # NOTE: an explicit config is taken as is (eos_token_id=None means no EOS); without one, the
        # model's own generation config supplies the defaults.
        gc = gc or getattr(self.model, "generation_config", None) or GenerationConfig()
        self.generation_config = gc
        self.eos_ids = eos_ids_of(gc)
        # NOTE: a field the engine does not implement is refused at submission (make_request), by name.
        try:
            self.sampling_defaults, self.generation_refusal = generation_defaults(gc, self.eos_ids), None
        except ValueError as e:
            self.sampling_defaults, self.generation_refusal = {}, str(e)
        self.default_max_new_tokens = gc.max_new_tokens or 20
        # NOTE: transformers' budget without max_new_tokens is max_length - prompt length
        self.default_max_length = gc.max_length if gc.max_new_tokens is None else None

    def check_prompt(self, input_ids: Sequence[int] | torch.Tensor) -> list[int]:
        """A prompt's token ids as a list after one vectorised check (ValueError naming `input_ids`)."""
        return check_token_ids(input_ids, self.vocab_size)

    def make_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        *,
        prompt_checked: bool = False,
        forced_ids: Sequence[int] | torch.Tensor | None = None,
        score_from: int | None = None,
        top_logprobs: int = 0,
        return_routed_experts: bool = False,
        sampling: SamplingParams | None = None,
        lora_slot: int | None = None,
        cache_salt: bytes = b"",
        **processors,
    ) -> Request:
        """Validate a submission (ValueError naming the field) and build its `Request`.

        `sampling`: the request's `SamplingParams` (its set fields over the generation config's; its `max_tokens`,
        `stop_token_ids`, `ignore_eos`, `logprobs` where the keywords leave them unset). The keywords
        (`temperature`, `top_k`, `top_p`, `seed` and `processors`, any `SamplingParams` field by name or alias:
        the seed API's transformers-style call) are set on top of it.

        Stop tokens: the engine's EOS ids (see `set_generation_config`; none with `ignore_eos`) plus the
        request's own `eos_token_ids`. `prompt_checked=True` says `input_ids` is the list `check_prompt`
        returned (a group's samples share one check). Scoring (`rollout.sampling.token_logprobs`): `forced_ids` follow
        the prompt teacher-forced, `score_from` the first given token whose logprob is recorded (then
        `max_new_tokens` may be 0), `top_logprobs` k <= 20 the top k of each scored and generated token.
        `return_routed_experts`: record the experts of every token run (`GenerationOutput.routed_experts`).
        `lora_slot` / `cache_salt`: the LoRA adapter slot it runs under and its prefix-cache salt (`loras()`)."""
        if request_id is None:
            request_id = f"req_{next(self._arrival)}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests and not self.follower:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        try:
            ids = input_ids if prompt_checked else self.check_prompt(input_ids)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        if self.generation_refusal is not None:
            raise ValueError(self.generation_refusal)
        sampling = self._sampling(sampling, temperature, top_k, top_p, seed, processors)
        if max_new_tokens is None:
            max_new_tokens = sampling.max_tokens
        top_logprobs = top_logprobs or sampling.logprobs
        ignore_eos = ignore_eos or sampling.ignore_eos
        if max_new_tokens is None:
            max_new_tokens = self.default_max_new_tokens
            if self.default_max_length is not None:
                max_new_tokens = self.default_max_length - len(ids)
        forced = check_scoring(forced_ids, score_from, top_logprobs, len(ids), self.vocab_size, max_new_tokens)
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < (score_from is None)
        ):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        total = len(ids) + len(forced) + max_new_tokens
        if self.max_context is not None and total > self.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"model's context of {self.max_context} tokens"
            )
        # NOTE: a sliding-window group holds at most its window's pages, whatever the length.
        need = self.scheduler.max_pages(total)
        if need > self.page_pool.num_pages:
            raise ValueError(
                f"request {request_id!r} needs {need} KV pages ({total} tokens) but the whole cache has "
                f"{self.page_pool.num_pages} pages of {self.page_size}; raise num_blocks or lower max_new_tokens"
            )
        routes = request_routes(self, total) if return_routed_experts else None
        eos = frozenset() if ignore_eos else self.eos_ids
        if eos_token_ids is not None:
            eos = eos | int_set(eos_token_ids, "eos_token_ids")
        eos = eos | frozenset(sampling.stop_token_ids)
        return Request(
            request_id=request_id, prompt_ids=ids, max_new_tokens=max_new_tokens, sampling=sampling,
            eos_token_ids=eos, streaming=streaming, return_logprobs=self.config.return_logprobs,
            arrival=next(self._arrival), forced_ids=forced, score_from=score_from, top_logprobs=top_logprobs,
            routes=routes, lora_slot=lora_slot, cache_salt=cache_salt,
        )

    def _sampling(self, sampling: SamplingParams | None, temperature, top_k, top_p, seed,
                  processors: dict) -> SamplingParams:
        """The request's `SamplingParams` with the keywords set on top, bound to this model
        (`sampling_fields.bind`: the generation config's fields under the request's own, unless
        `per_request_processors` is off; token ids checked against the vocabulary)."""
        keywords = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, **processors}
        keywords = {k: v for k, v in keywords.items() if v is not None}
        if keywords:
            sampling = SamplingParams.from_fields({**(sampling.set_fields() if sampling is not None else {}),
                                                   **keywords})
        return bind(sampling or SamplingParams(), self.sampling_defaults, self.vocab_size,
                    self.config.per_request_processors)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use by a live request")
        if request.routes is not None:
            start_recording(self)  # NOTE: between steps (the stepping thread adds requests)
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def cancel(self, request_id: str) -> Request | None:
        self.settle()  # NOTE: the step in flight's token is the request's, as in a synchronous engine
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finalize(req, RequestStatus.CANCELLED, "cancelled")
        return req

    def fail(self, request: Request, error: str) -> None:
        self._finalize(request, RequestStatus.FAILED, "error", error)

    def fail_all(self, error: str) -> list[Request]:
        self.settle()
        reqs = list(self.requests.values())
        for req in reqs:
            self.fail(req, error)
        return reqs

    def _finalize(self, req: Request, status: RequestStatus, reason: str, error: str | None = None) -> None:
        self.scheduler.remove(req)
        req.status, req.finish_reason, req.error = status, reason, error
        req.policy_version = self.policy_version
        self.requests.pop(req.request_id, None)
        self.sampler.forget(req.request_id)
        self.runner.release(req)
        if self.speculator is not None:  # NOTE: its tokens may draft for its prompt's later rollouts
            self.speculator.finished(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.pipeline is not None and self.pipeline.busy())

    # ---------------------------------------------------------------- step
    def enable_async(self, queue=None) -> None:
        """Queue each step before the previous one's tokens are read (`rollout.engine.async_steps`; `queue`: tests')."""
        self.pipeline = AsyncSteps(self, self._finalize, self._check_weights, self._count_prompt_tokens, self._unstick,
                                   queue)

    def settle(self) -> None:
        if self.pipeline is not None:  # NOTE: resolve the asynchronous step in flight (rollout.engine.async_steps)
            self.pipeline.settle()

    def step(self) -> list[Request]:
        """One engine step. Returns the requests with news (final, or a new token when streaming).

        The heap that exists when it starts is frozen for it (`rollout.engine.heap`): no full garbage collection
        walks the trainer's objects in the middle of a step."""
        with frozen_heap:
            if self.pipeline is not None:
                return self.pipeline.step()
            if self.scheduler.waiting:
                self._check_weights()
            out = self.scheduler.schedule()
            if not out:
                return self._unstick()
            return self.run_step(out)

    def run_step(self, out: SchedulerOutput) -> list[Request]:
        """Run, sample and update one scheduled step, synchronously."""
        spec = self.speculator if out.decode_only else None
        if spec is not None:
            if (news := spec.step(out)) is not None:
                return news
            news = self._run_step(out)
            spec.ran_plain()  # NOTE: the plain step it handed back, timed to its end
            return news
        return self._run_step(out)

    def _run_step(self, out: SchedulerOutput) -> list[Request]:
        self._count_prompt_tokens(out)
        try:
            logits, sampled, scores = self.runner.execute(out)
            reqs = [out.scheduled[i].request for i in sampled]
            mode = self.config.logprobs_mode if self.config.return_logprobs else None
            record_scores(scores, self.sampler.processors, self.config.logprobs_mode)
            result = self.sampler(logits, [r.sampling for r in reqs], [r.request_id for r in reqs], mode,
                                  requests=reqs, top_mode=self.config.logprobs_mode)
        except Exception as e:  # NOTE: a failing step fails its own requests; the engine keeps serving
            logger.exception("engine step failed; failing its %d requests", len(out.scheduled))
            failed = [s.request for s in out.scheduled]
            for req in failed:
                self.fail(req, f"engine step failed: {type(e).__name__}: {e}")
            return failed
        self.scheduler.after_step(out)
        news: list[Request] = []
        logprobs = [None] * len(reqs) if result.logprobs is None else result.logprobs
        tops = [None] * len(reqs) if result.top is None else result.top
        masks = [None] * len(reqs) if result.masks is None else result.masks
        for req, token, logprob, top, mask in zip(reqs, result.tokens, logprobs, tops, masks, strict=True):
            if top is not None:
                req.top.append(top)
            if mask is not None:
                req.masks.append(mask)
            reason = req.append_token(token, logprob, self.policy_version)
            if reason is not None:
                self._finalize(req, RequestStatus.FINISHED, reason)
                news.append(req)
            elif req.streaming:
                news.append(req)
        self.stats["generated_tokens"] += len(reqs)
        for s in out.scheduled:  # NOTE: a scoring-only request (max_new_tokens 0) ends with its given tokens
            if s.request.max_new_tokens == 0 and s.request.remaining == 0 and not s.request.status.is_final:
                self._finalize(s.request, RequestStatus.FINISHED, "length")
                news.append(s.request)
        return news

    def _count_prompt_tokens(self, out: SchedulerOutput) -> None:
        """Prompt tokens computed and tokens computed again after a preemption (below `high_water`)."""
        if out.decode_only:  # NOTE: DECODING rows compute a generated token past their high-water mark
            return
        recomputed = prompt = 0
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            if start < req.high_water:
                recomputed += min(end, req.high_water) - start
            if start < len(req.prompt_ids):
                prompt += min(end, len(req.prompt_ids)) - start
        self.stats["recomputed_tokens"] += recomputed
        self.stats["computed_prompt_tokens"] += prompt

    def _unstick(self) -> list[Request]:
        """Nothing could be scheduled although work is queued: fail the head request if it cannot fit."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        req = self.scheduler.waiting[0]
        self.fail(req, f"request needs more KV pages than are free in a cache of {self.page_pool.num_pages} pages")
        return [req]

    def _check_weights(self) -> None:
        """Before admitting requests: parameters changed in place since the last check (an optimizer step
        on the trainer's own model, a `copy_` without `update_weights`) make every cached prefix stale."""
        # NOTE: not under tensor parallelism: ranks would notice at different rounds (use update_weights)
        if self.tp is None and weights_version(self._weights) != self._weights_seen:
            dropped = self.reset_prefix_cache()
            logger.info("parameters changed in place (version counters): dropped %d cached prefix pages", dropped)

    # ------------------------------------------------------------- control
    # ------------------------------------------------------------ weights
    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer the engine runs, by name (tied names each listed): what a weight push fills."""
        view = self.view
        return {**dict(view.named_parameters(remove_duplicate=False)),
                **dict(view.named_buffers(remove_duplicate=False))}

    def load_weights(self, source, recompute_kv: bool = False, version: int | None = None) -> tuple[int, int]:
        """New policy weights, copied in place (`rollout.weights.in_place.copy_weights`: a module, a state dict or
        (name, tensor) pairs, checked by name and shape); see `_after_weights`. Called between two steps."""
        return self._after_weights(lambda: copy_weights(self.view, source), recompute_kv, version)

    def load_policy_adapter(self, weights, recompute_kv: bool = False,
                            version: int | None = None) -> tuple[int, int]:
        """A PEFT policy's new adapter tensors (`read_adapter`'s), into its slot; see `_after_weights`."""
        return self._after_weights(lambda: self.loras(create=False).load_policy(weights), recompute_kv, version)

    def _after_weights(self, copy, recompute_kv: bool, version: int | None) -> tuple[int, int]:
        """The one after-care of every weight change: `copy()` copies the new tensors in (returns how many); then
        every prefix page computed with the old weights is dropped, the running requests' KV too with
        `recompute_kv`, and `policy_version` becomes `version` (default: one more). Returns (version, copied)."""
        self.settle()  # NOTE: an asynchronous step in flight runs under the old weights, as in a synchronous engine
        try:
            copied = copy()
        finally:  # NOTE: a stream of (name, tensor) rejected half way has changed weights too
            self.reset_prefix_cache()
            if recompute_kv:
                self.scheduler.drop_kv()
        self.policy_version = self.policy_version + 1 if version is None else int(version)
        return self.policy_version, copied

    # --------------------------------------------------------------- LoRA
    def loras(self, create: bool = True) -> EngineLoras | None:
        """The engine's adapters (made at the first `add_lora`); ValueError when its config or mode has none."""
        if self.runner.lora is not None or not create:
            return self.runner.lora
        config = self.config
        if config.max_loras < 1:
            raise ValueError("LoRA adapters need slots: build the engine with ContinuousBatchingConfig(max_loras=K, "
                             "max_lora_rank=R) (max_loras is 0)")
        compiled = ("a compiled forward (default_compile_level >= 1, varlen_compile_config, decode_compile_config, "
                    "use_cuda_graph)")
        for refused, why in (
            (self.tp is not None, "tensor parallelism"),
            (config.batch_invariant, "batch_invariant=True"),
            (self.runner.forward is not self.runner.model, compiled),
        ):
            if refused:
                raise ValueError(f"LoRA adapters are not supported with {why} yet")
        self.runner.lora = EngineLoras(self.view, config.max_loras, config.max_lora_rank, self.device)
        return self.runner.lora

    def adopt_peft_policy(self, model) -> str:
        """Serve the PeftModel `model` as base + its active adapter: the view's PEFT layers back to their base
        linears (one base copy, the user's), the adapter in a slot; returns the adapter's name."""
        name = active_adapter(model)
        strip_peft_layers(self.view)
        self.loras().adopt_policy(name, read_adapter(model, adapter_name=name))
        return name

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page (and anything that would share KV computed so far), and the
        weight copies of the view's routed linears (`drop_weight_copies`, rebuilt at the next step from the current
        weights)."""
        self.scheduler.forget_prefixes()
        if self.tp is not None:
            self.tp.flushes += 1
        drop_weight_copies(self.view)
        self._weights_seen = weights_version(self._weights)
        return self.page_pool.reset_prefix_cache()

    def release_memory(self) -> int:
        """Free the KV tensors while idle (their contents, and so the prefix cache, are lost)."""
        self.settle()
        if self.has_work():
            raise RuntimeError("release_memory needs an idle engine")
        self.reset_prefix_cache()
        return self.cache.release()

    def restore_memory(self) -> int:
        return self.cache.reallocate()

    cache_stats = engine_cache_stats
