"""`RolloutEngine`: the RL-facing API on top of one persistent `ContinuousBatchingManager`."""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from .config import ContinuousBatchingConfig
from .manager import ContinuousBatchingManager
from .model_facts import eos_ids_of
from .requests import GenerationOutput, RequestStatus

logger = logging.getLogger("rollout")

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass
class RolloutBatch:
    """Loss-ready rollouts: N = len(prompts) x group_size rows, a group's samples adjacent.

    Tensors live on the model's device. Logprobs are fp32 and 0 where the mask is 0.
    """

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] 1 on generated tokens
    logprobs: torch.Tensor  # [N, T] fp32
    group_ids: torch.Tensor  # [N] index of the prompt each row answers
    temperatures: torch.Tensor  # [N] fp32
    finish_reasons: list[str]  # [N] "stop" | "length" | ...
    policy_version: int
    completions_text: list[str] | None = None  # [N] decoded completions when a tokenizer is known

    @property
    def input_ids(self) -> torch.Tensor:  # [N, P + T]
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # [N, P + T]
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def completion_lengths(self) -> torch.Tensor:  # [N]
        return self.completion_mask.sum(dim=1)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved = {
            f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return RolloutBatch(**moved)


class RolloutEngine:
    """Generation for RL: groups, per-prompt temperatures, logprobs, in-place weight swaps.

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
        self.generation_config = self._generation_config(model, tokenizer, generation_config)
        self.manager = ContinuousBatchingManager(model, self.generation_config, config)
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
        return self.manager._core().policy_version

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = self.generation_config.pad_token_id
        if pad is None:
            eos = self.generation_config.eos_token_id
            pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
        return int(pad)

    def cache_stats(self) -> dict:
        return self.manager.cache_stats()

    # --------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        temps: float | Sequence[float] = 1.0,
        group_size: int = 1,
        max_new_tokens: int | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        apply_chat_template: bool = False,
        progress: bool = False,
    ) -> RolloutBatch:
        """Sample `group_size` completions per prompt; returns a `RolloutBatch` (rows grouped by prompt).

        `temps` is one temperature for all prompts or one per prompt (0 = greedy). With `seed`, sample
        j of prompt i draws from its own stream seeded by a hash of (seed, i * group_size + j), so a call
        is reproducible and two different seeds share no stream."""
        self._check_open()
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of prompts, got a single string")
        ids = [self._encode(p, apply_chat_template) for p in prompts]
        if isinstance(temps, (int, float)):
            temps = [float(temps)] * len(ids)
        temps = [float(t) for t in temps]
        if len(temps) != len(ids):
            raise ValueError(f"temps has {len(temps)} values for {len(ids)} prompts")
        for t in temps:
            if math.isnan(t) or t < 0:
                raise ValueError(f"temps must be non-negative numbers, got {t}")
        with self._lock:
            if self._asleep:
                self.wake()
            self._calls += 1
            with self.manager.driving():  # NOTE: before submitting, so the loop thread never takes a step
                rids = self._submit(ids, temps, group_size, max_new_tokens, top_k, top_p, seed)
                outputs = self._collect(rids, progress)
        failed = [o for o in outputs if o.status == RequestStatus.FAILED]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outputs)} rollouts failed; first error: {failed[0].error}")
        return self._to_batch(ids, outputs, temps, group_size)

    def _encode(self, prompt, apply_chat_template: bool) -> list[int]:
        if isinstance(prompt, str) or (apply_chat_template and isinstance(prompt, list) and prompt
                                       and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer= to RolloutEngine")
            if apply_chat_template:
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                return self.manager._core().check_prompt(out["input_ids"] if isinstance(out, Mapping) else out)
            return self.manager._core().check_prompt(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return self.manager._core().check_prompt(prompt)

    def _submit(self, ids, temps, group_size, max_new_tokens, top_k, top_p, seed) -> list[str]:
        """Queue every sample at once (all or none); prompts are the checked lists of `_encode`."""
        core = self.manager._core()
        reqs = [
            core.make_request(
                prompt, request_id=f"rollout{self._calls}_{i}_{j}", max_new_tokens=max_new_tokens,
                temperature=temps[i], top_k=top_k, top_p=top_p,
                seed=None if seed is None else _row_seed(seed, i * group_size + j), prompt_checked=True,
            )
            for i, prompt in enumerate(ids)
            for j in range(group_size)
        ]
        if not self.manager.submit(reqs):
            raise RuntimeError("the rollout engine's manager is not running")
        return [r.request_id for r in reqs]

    def _collect(self, rids: list[str], progress: bool) -> list[GenerationOutput]:
        """Step the engine on this thread until every request of `rids` has its result; call inside
        `manager.driving()` (one OpenMP team, the caller's, then runs the forward passes)."""
        outputs: dict[str, GenerationOutput] = {}
        manager = self.manager
        with tqdm(total=len(rids), desc="rollout", unit="seq", disable=not progress, leave=False) as bar:
            pending = set(rids)
            while pending:
                out = manager.get_result(timeout=0)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("the rollout engine's manager stopped with requests pending")
                    if not manager.step_here():  # NOTE: nothing to step: another thread holds our results
                        out = manager.get_result(timeout=0.05)
                    if out is None:
                        continue
                if out.request_id in pending:
                    pending.discard(out.request_id)
                    outputs[out.request_id] = out
                    bar.update(1)
        return [outputs[r] for r in rids]

    def _to_batch(self, ids, outputs, temps, group_size) -> RolloutBatch:
        n = len(outputs)
        pad = self.pad_token_id
        p_len = max((len(p) for p in ids), default=0)
        t_len = max((len(o.generated_tokens) for o in outputs), default=0)
        prompt_ids = torch.full((n, p_len), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
        completion_ids = torch.full((n, t_len), pad, dtype=torch.long)
        completion_mask = torch.zeros((n, t_len), dtype=torch.long)
        logprobs = torch.zeros((n, t_len), dtype=torch.float32)
        for row, out in enumerate(outputs):
            p = ids[row // group_size]
            if p:
                prompt_ids[row, p_len - len(p):] = torch.tensor(p)
                prompt_mask[row, p_len - len(p):] = 1
            k = len(out.generated_tokens)
            if k:
                completion_ids[row, :k] = torch.tensor(out.generated_tokens)
                completion_mask[row, :k] = 1
                logprobs[row, :k] = torch.tensor(out.logprobs, dtype=torch.float32)
        texts = None
        if self.tokenizer is not None:
            texts = self.tokenizer.batch_decode([o.generated_tokens for o in outputs], skip_special_tokens=True)
        batch = RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            logprobs=logprobs,
            group_ids=torch.arange(len(ids)).repeat_interleave(group_size),
            temperatures=torch.tensor(temps, dtype=torch.float32).repeat_interleave(group_size),
            finish_reasons=[o.finish_reason for o in outputs],
            policy_version=min((o.policy_version for o in outputs), default=self.policy_version),
            completions_text=texts,
        )
        return batch.to(self.device)

    # ---------------------------------------------------------- weight update
    def update_weights(self, source, in_flight: str = "finish") -> int:
        """Load new policy weights in place; returns the new `policy_version`.

        `source`: an nn.Module (DDP / accelerate / compile wrappers are unwrapped), a state dict, or an
        iterable of (name, tensor). Values are cast to each parameter's dtype and copied into its
        existing storage. Built on the trainer's own module, `update_weights(model)` copies nothing.
        Every prefix-cache page computed with the old weights is dropped. Requests in flight finish
        under the old weights first (`in_flight="finish"`) or are aborted with their partial output
        (`in_flight="abort"`), or, with the manager paused in "keep" mode, stay where they are and go on
        under the new weights after `resume()` (`in_flight="keep"`)."""
        self._check_open()
        if in_flight not in ("finish", "abort", "keep"):
            raise ValueError(f"in_flight must be 'finish', 'abort' or 'keep', got {in_flight!r}")
        if in_flight == "keep" and self.manager._paused != "keep":
            raise ValueError("in_flight='keep' needs the manager paused with mode='keep'")
        if in_flight == "abort":
            self._abort_live()
        with self._lock:  # NOTE: a generate() running in another thread finishes first
            if in_flight != "keep":
                self._wait_idle()
            with self.manager.step_lock:
                core = self.manager._core()
                try:
                    copied = self._copy_weights(source)
                finally:  # NOTE: a stream of (name, tensor) rejected half way has changed weights too
                    core.reset_prefix_cache()
                core.policy_version += 1
            logger.info("policy weights updated (version %d, %d tensors copied)", core.policy_version, copied)
            return core.policy_version

    def _abort_live(self) -> None:
        # NOTE: every request not yet delivered, not only `core.requests`: a request the loop has taken
        # from the inbox but not yet added to the core (or one still queued) would otherwise run on.
        with self.manager._cv:
            live = list(self.manager._live)
        for rid in live:
            self.manager.cancel_request(rid)

    def _wait_idle(self, poll: float = 0.002) -> None:
        core = self.manager._core()
        while True:
            with self.manager.step_lock:
                if not core.has_work() and not self.manager._inbox:
                    return
            time.sleep(poll)

    def _copy_weights(self, source) -> int:
        module = _unwrap(source) if isinstance(source, torch.nn.Module) else None
        # NOTE: copy into the tensors the engine runs, its view's. Built on the trainer's model they are the
        # trainer's own tensors (same data_ptr: nothing is copied), unless the trainer has since replaced
        # its parameters (e.g. `load_state_dict(..., assign=True)`): then they are copied like any source.
        view = self.manager._core().view
        targets = dict(view.named_parameters(remove_duplicate=False))
        targets.update(dict(view.named_buffers(remove_duplicate=False)))
        if module is not None:
            source = module.state_dict()
        if isinstance(source, Mapping):
            # NOTE: check a whole dict before copying anything, so that a rejected update changes nothing
            # (a stream is copied as it comes, never held in memory at once).
            unknown = [name for name, value in source.items() if _target_of(targets, name, value) is None]
            if unknown:
                raise ValueError(_unknown_names(unknown))
            items: Iterable = source.items()
        else:
            items = source
        copied, unknown = 0, []
        done: set[tuple[int, int]] = set()  # (target, value) storages: a tied weight is copied once
        with torch.no_grad():
            for name, value in items:
                target = _target_of(targets, name, value)
                if target is None:
                    unknown.append(name)
                    continue
                pair = (target.data_ptr(), value.data_ptr())
                if pair[0] != pair[1] and pair not in done:
                    target.copy_(value)
                    done.add(pair)
                    copied += 1
        if unknown:
            raise ValueError(_unknown_names(unknown))
        return copied

    # ---------------------------------------------------------------- memory
    def sleep(self) -> int:
        """Release the KV cache (and any offload buffer) between rollouts; returns the bytes freed."""
        self._check_open()
        with self._lock:
            self._wait_idle()
            with self.manager.step_lock:
                freed = self.manager._core().release_memory()
            self._asleep = True
            return freed

    def wake(self) -> int:
        """Take the KV cache memory back; returns its bytes."""
        self._check_open()
        with self._lock, self.manager.step_lock:
            self._asleep = False
            return self.manager._core().restore_memory()

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


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _row_seed(seed: int, row: int) -> int:
    """The seed of one sample's stream. NOTE: not `seed + row`, which makes seed s+1 replay the
    streams of seed s shifted by one row (same prompt -> the same samples again)."""
    return _mix64((_mix64(seed & _MASK64) + row) & _MASK64) >> 1  # >> 1: fits a signed int64


def _target_of(targets: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> torch.Tensor | None:
    """The engine tensor `name` (wrapper prefixes stripped) updates, None if unknown; ValueError on a
    shape mismatch."""
    target = targets.get(_strip_prefixes(name))
    if target is not None and target.shape != value.shape:
        raise ValueError(f"update_weights: {name} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
    return target


def _unknown_names(names: list[str]) -> str:
    return f"update_weights: unknown parameter names {names[:5]}{'...' if len(names) > 5 else ''}"


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while True:
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def _strip_prefixes(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                changed = True
    return name
