"""`RolloutEngine`: the RL-facing API on top of one persistent `ContinuousBatchingManager`.

`generate` encodes the prompts, submits every sample of every group at once and steps the engine on the
calling thread (`rollout.engine.collect`) until they are done, then pads them into a `RolloutBatch`
(`rollout.api.batch`). `update_weights` copies new weights in (`rollout.weights.in_place`) between steps.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from rollout.api.batch import RolloutBatch, pack_batch
from rollout.api.chat import chat_template_ids
from rollout.api.lora import LoraChoice, LoraMethods, policy_config
from rollout.api.score_batch import ScoreBatch, pack_scores, score_inputs
from rollout.config import ContinuousBatchingConfig
from rollout.engine.collect import collect
from rollout.engine.manager import ContinuousBatchingManager
from rollout.in_flight import UPDATE_DEFAULT, InFlight, check_mode, check_recompute_kv
from rollout.model.model_facts import eos_ids_of
from rollout.prompts import check_token_ids
from rollout.requests import RequestStatus
from rollout.sampling.seeding import call_seeds
from rollout.sampling_params import SamplingParams, per_prompt
from rollout.weights.checkpoint import load_checkpoint
from rollout.weights.lora_adapters import is_peft_model

logger = logging.getLogger("rollout")


class RolloutEngine(LoraMethods):
    """Generation for RL: groups, per-prompt temperatures, logprobs, in-place weight swaps, LoRA adapters
    (`rollout.api.lora`).

    Args:
        model: the policy (a HF causal LM). Its parameters are shared, never copied: an engine built on
            the trainer's own model sees optimizer steps at once (call `update_weights(model)` to bump
            the version and drop stale prefix KV).
        tokenizer: encodes string prompts and decodes completions (optional).
        config: engine configuration; logprobs are always returned (mode from the config).
        generation_config: defaults (max_new_tokens, eos); default sampling is plain softmax sampling
            (no top-k / top-p) at the temperature passed to `generate`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        config: ContinuousBatchingConfig | None = None,
        generation_config: GenerationConfig | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        config = (config or ContinuousBatchingConfig()).replace(return_logprobs=True)
        # NOTE: a PEFT policy: base + its adapter, unmerged (`rollout.api.lora`), where it can run so
        lora_config = policy_config(model, config) if is_peft_model(model) else None
        peft, config = lora_config is not None, lora_config or config
        self.generation_config = self._generation_config(model, tokenizer, generation_config)
        self.manager = ContinuousBatchingManager(model, self.generation_config, config)
        self._policy_lora = self.manager.adopt_peft_policy(model) if peft else None
        self.manager.start()
        self.device = next(model.parameters()).device
        self._lock = threading.RLock()  # one generate / update / sleep at a time
        self._calls = 0
        self._asleep = False
        self._closed = False

    @staticmethod
    def _generation_config(model, tokenizer, given: GenerationConfig | None) -> GenerationConfig:
        """The engine's defaults. Stop tokens: the tokenizer's EOS plus the given config's, or without
        one the model's `generation_config` (int or list: Llama 3 / Qwen 2.5 Instruct list several)."""
        if given is not None:
            gc = copy.deepcopy(given)
        else:
            gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=256,
                                  pad_token_id=getattr(tokenizer, "pad_token_id", None))
            given = getattr(model, "generation_config", None)
        eos = sorted(eos_ids_of(tokenizer, given))
        gc.eos_token_id = eos[0] if len(eos) == 1 else (eos or None)
        return gc

    # ------------------------------------------------------------- properties
    @property
    def policy_version(self) -> int:
        return self.manager.policy_version

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = self.generation_config.pad_token_id
        if pad is None:
            eos = self.generation_config.eos_token_id
            pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
        return int(pad)

    @property
    def is_asleep(self) -> bool:
        """Whether `sleep()` released the KV cache (the next `generate` or `wake()` takes it back)."""
        return self._asleep

    @property
    def tensor_parallel(self):
        """The tensor-parallel group this engine steps in lockstep with (`rollout.engine.tp`), None without TP."""
        return self.manager.tp

    def cache_stats(self) -> dict:
        return self.manager.cache_stats()

    # --------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        temps: float | Sequence[float] | None = None,
        group_size: int = 1,
        max_new_tokens: int | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        apply_chat_template: bool = False,
        progress: bool = False,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        return_routed_experts: bool = False,
        lora: LoraChoice = None,
        prompt_index: int = 0,
    ) -> RolloutBatch:
        """Sample `group_size` completions per prompt; returns a `RolloutBatch` (rows grouped by prompt).

        `sampling`: a `SamplingParams` for every prompt, or one per prompt (`rollout.sampling_params`: penalties,
        `min_p`, `logit_bias`, `bad_words_ids`, `stop_token_ids`, `logprobs` (the top k of each step,
        `batch.top_logprobs` / `batch.top_ids` [N, T, k]), ...; unset fields take the generation config's). The
        keywords set the same fields: `temps` (one temperature for all prompts or one per prompt, 0 = greedy,
        default 1.0), `top_k`, `top_p`, `seed`, `max_new_tokens` (`max_tokens`); naming a field both ways is a
        ValueError. With a seed, sample j of prompt i draws from the stream `sample_seed(group_seed(seed, i), j)`
        (`rollout.sampling.seeding`, the rule `rollout serve` and `RolloutPool` follow too): a call is
        reproducible, gives the same samples through a pool of servers, and two different seeds share no stream.
        `return_routed_experts` (an MoE policy) adds `batch.routed_experts` [N, P + T, L, k]
        (`rollout.model.routes`). `lora`: the LoRA adapter (`add_lora`) every prompt runs under, or one name or
        None (the base model) per prompt. `prompt_index`: these prompts are prompts `prompt_index, ...` of a
        larger seeded call (a fleet's shard), seeded as such."""
        self._check_open()
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if isinstance(prompt_index, bool) or not isinstance(prompt_index, int) or prompt_index < 0:
            raise ValueError(f"prompt_index must be a non-negative int, got {prompt_index!r}")
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of prompts, got a single string")
        ids = [self._encode(p, apply_chat_template) for p in prompts]
        each = per_prompt(sampling, len(ids), temps=temps, top_k=top_k, top_p=top_p, seed=seed,
                          max_new_tokens=max_new_tokens)
        with self._lock:
            if self._asleep:
                self.wake()
            self._calls += 1
            loras = self._lora_rows(lora, len(ids))
            with self.manager.driving():  # NOTE: before submitting, so the loop thread never takes a step
                rids = self._submit(ids, each, group_size, return_routed_experts, loras, prompt_index)
                outputs = collect(self.manager, rids, progress)
        failed = [o for o in outputs if o.status == RequestStatus.FAILED]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outputs)} rollouts failed; first error: {failed[0].error}")
        top_logprobs = max(s.logprobs for s in each) if each else 0
        return pack_batch(ids, outputs, [s.temperature for s in each], group_size, self.pad_token_id,
                          self.policy_version, self.device, self.tokenizer, top_logprobs, return_routed_experts)

    def _encode(self, prompt, apply_chat_template: bool) -> list[int]:
        if isinstance(prompt, str) or (apply_chat_template and isinstance(prompt, list) and prompt
                                       and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer= to RolloutEngine")
            if apply_chat_template:
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                return self.manager.check_prompt(chat_template_ids(self.tokenizer, messages))
            return self.manager.check_prompt(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return self.manager.check_prompt(prompt)

    def _submit(self, ids, sampling: list[SamplingParams], group_size, routes=False, loras=None,
                first=0) -> list[str]:
        """Queue every sample at once (all or none); prompts are the checked lists of `_encode`, `sampling` one
        `SamplingParams` each; `loras`: each prompt's (adapter slot, cache salt), None for the base model;
        `first`: the call's first prompt index."""
        reqs = []
        for i, prompt in enumerate(ids):
            seeds = call_seeds(sampling[i].seed, 1, group_size, first + i)
            lora_slot, cache_salt = loras[i] if loras is not None else (None, b"")
            reqs += [self.manager.make_request(
                prompt, request_id=f"rollout{self._calls}_{i}_{j}", sampling=sampling[i], seed=seeds[j],
                prompt_checked=True, return_routed_experts=routes, lora_slot=lora_slot, cache_salt=cache_salt)
                for j in range(group_size)]
        if not self.manager.submit(reqs):
            raise RuntimeError("the rollout engine's manager is not running")
        return [r.request_id for r in reqs]

    # ------------------------------------------------------------------ score
    def score(
        self,
        prompt_ids: RolloutBatch | Sequence[Sequence[int]] | Sequence[str],
        completion_ids: Sequence[Sequence[int]] | Sequence[str] | None = None,
        top_logprobs: int = 0,
        prompt_logprobs: bool = False,
        temps: float | Sequence[float] | None = None,
        progress: bool = False,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        return_routed_experts: bool = False,
        lora: LoraChoice = None,
    ) -> ScoreBatch:
        """Teacher-forced logprobs of `completion_ids[i]` after `prompt_ids[i]`, through the paged engine.

        Rows sharing a prompt compute it once (the first forks its KV to the others, and prompts in the
        prefix cache are not recomputed); long rows are prefilled in chunks. `prompt_ids` may be a
        `RolloutBatch` (its completions after its prompts, at its temperatures, `ScoreBatch` shaped like it).
        Logprobs follow the engine's `logprobs_mode`: raw, or processed: the logprob `generate` reports for
        the same token sampled with the same arguments (`temps`: one, or one per row, default 1.0, 0 means
        raw; `sampling`: one `SamplingParams` or one per row, its `top_k`, `top_p` and logits processors), each
        position's processors applied to prompt + the completion before it. Prompt positions
        (`prompt_logprobs`) are scored as if the prompt ended there. Returns a `ScoreBatch`
        (`return_routed_experts`: with `routed_experts` [N, P + T, L, k], prompt and completion tokens). `lora`: as
        `generate`'s, one adapter name or None per row."""
        self._check_open()
        prompts, completions, per_row, width = score_inputs(prompt_ids, completion_ids, temps,
                                                            lambda p: self._encode(p, False), self._encode_completion,
                                                            sampling)
        first_of = None
        if prompt_logprobs:  # NOTE: the first row of each distinct prompt scores it; the others fork its KV
            seen: dict[tuple[int, ...], int] = {}
            first_of = [seen.setdefault(tuple(p), i) for i, p in enumerate(prompts)]
        with self._lock:
            if self._asleep:
                self.wake()
            self._calls += 1
            loras = self._lora_rows(lora, len(prompts))
            reqs = [
                self.manager.make_request(
                    p, request_id=f"score{self._calls}_{i}", max_new_tokens=0, sampling=per_row[i],
                    prompt_checked=True, forced_ids=c, top_logprobs=top_logprobs,
                    score_from=1 if first_of is not None and first_of[i] == i else len(p),
                    return_routed_experts=return_routed_experts,
                    **({} if loras is None else {"lora_slot": loras[i][0], "cache_salt": loras[i][1]}),
                )
                for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
            ]
            with self.manager.driving():
                if not self.manager.submit(reqs):
                    raise RuntimeError("the rollout engine's manager is not running")
                outputs = collect(self.manager, [r.request_id for r in reqs], progress, desc="score")
        failed = [o for o in outputs if o.status == RequestStatus.FAILED]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outputs)} scoring rows failed; first error: {failed[0].error}")
        return pack_scores(prompts, completions, outputs, top_logprobs, first_of, width, self.device,
                           return_routed_experts)

    def _encode_completion(self, completion) -> list[int]:
        if isinstance(completion, str):
            if self.tokenizer is None:
                raise ValueError("string completions need a tokenizer: pass tokenizer= to RolloutEngine")
            completion = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
        if len(completion) == 0:
            return []
        return check_token_ids(completion, self.manager.vocab_size, "completion_ids")

    # ---------------------------------------------------------- weight update
    def update_weights(self, source, in_flight: InFlight = UPDATE_DEFAULT, recompute_kv: bool = False, *,
                       version: int | None = None) -> int:
        """Load new policy weights in place; returns the new `policy_version`.

        `source`: an nn.Module (DDP / accelerate / compile wrappers are unwrapped), a state dict, or an
        iterable of (name, tensor). Values are cast to each parameter's dtype and copied into its
        existing storage. Built on the trainer's own module, `update_weights(model)` copies nothing.
        Every prefix-cache page computed with the old weights is dropped. Requests in flight
        (`rollout.in_flight`) finish under the old weights first (`in_flight="wait"`, the default) or are
        aborted with their partial output (`"abort"`), or stay where they are and go on under the new
        weights (`"keep"`):
        on a live engine (a `generate` on another thread, the engine thread) the update lands between two
        steps; paused in "keep" mode, they go on after `resume()`. Their KV computed so far is kept (it
        is their own context, never shared with another request), or with `recompute_kv=True` dropped and
        recomputed under the new weights before their next token. Each token's version is in
        `RolloutBatch.versions`. A PEFT policy (`RolloutEngine(peft_model)`) takes a PeftModel here and copies its
        adapter's tensors only. `source` may also be a `save_pretrained` directory. `version`: the version the
        new weights take (a fleet's count), default one more."""
        self._check_open()
        check_mode(in_flight, "in_flight")
        if self._policy_lora is not None and is_peft_model(source):  # NOTE: the adapter's tensors only
            return self._update_policy(source, in_flight, recompute_kv, version)
        check_recompute_kv(in_flight, recompute_kv)
        if isinstance(source, (str, os.PathLike)):
            source = load_checkpoint(source)
        return self._swap_weights(lambda m: m.load_weights(source, recompute_kv, version), in_flight, "weights")

    def _swap_weights(self, load, in_flight: InFlight, what: str) -> int:
        """`load(manager)` (the manager's `load_weights` or `load_policy_adapter`: the core copies the tensors in and
        does the after-care, prefix cache and version) as an update under `in_flight`, between two steps."""
        with self._between_steps(in_flight):
            version, copied = load(self.manager)
        logger.info("policy %s updated (version %d, %d tensors copied)", what, version, copied)
        return version

    @contextlib.contextmanager
    def _between_steps(self, in_flight: InFlight):
        """Held between two steps once the requests in flight were aborted ("abort") or have finished ("wait",
        "abort"); "keep" neither waits nor takes `_lock` (a generate() on another thread holds it), only the step
        lock."""
        if in_flight == "abort":
            self.manager.abort_live()
        with contextlib.nullcontext() if in_flight == "keep" else self._lock:
            if in_flight != "keep":
                self.manager.wait_idle()
            with self.manager.step_lock:
                yield

    # ---------------------------------------------------------------- memory
    def sleep(self) -> int:
        """Release the KV cache (and any offload buffer) between rollouts; returns the bytes freed."""
        self._check_open()
        with self._between_steps("wait"):
            freed = self.manager.release_memory()
            self._asleep = True
        return freed

    def wake(self) -> int:
        """Take the KV cache memory back; returns its bytes."""
        self._check_open()
        with self._lock, self.manager.step_lock:
            self._asleep = False
            return self.manager.restore_memory()

    # --------------------------------------------------------------- closing
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.manager.destroy()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RolloutEngine is closed")

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

