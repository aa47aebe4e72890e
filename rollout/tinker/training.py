"""The training side of the Tinker service: LoRA adapters (PEFT) on one trainer copy of the base model, each
with its own Adam, its own gradients, its own loss.

`Trainer` holds one `PeftModel` over a copy of the base; every training client (`create_model`) is one adapter
of it, selected before each pass (`set_adapter`), so two clients never see each other's tensors. A pass runs
the Tinker datum convention: `model_input` of L tokens, `loss_fn_inputs` of L entries each (position t scores
`target_tokens[t]` after tokens `[0..t]`), losses summed over tokens and datums:

- `cross_entropy`: `-(weights * logp).sum()`
- `importance_sampling`: `-(exp(logp - logprobs) * advantages).sum()` (`logprobs`: the sampler's)
- `ppo`: `-min(ratio * A, clip(ratio, clip_low_threshold, clip_high_threshold) * A).sum()` (0.8 / 1.2 default)

Gradients add up over `forward_backward` calls until `optim_step` (Adam, the SDK's `AdamParams`: decoupled
weight decay, `grad_clip_norm` > 0 clips the adapter's global norm). With `invariant=True` every pass runs
through `rollout.invariant.forward.InvariantForward` (the engine's batch-invariant ops): the logprobs it
returns are the bits an invariant engine samples with for the same adapter.
"""

from __future__ import annotations

import copy
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rollout.tinker.wire import Datum, UserError

LOSSES = ("cross_entropy", "importance_sampling", "ppo")
LORA_ALPHA = 32  # NOTE: Tinker's fixed alpha; the adapter's scale is alpha / rank
INPUTS = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}


def linear_kinds(model: torch.nn.Module) -> dict[str, list[str]]:
    """Full names of the base's `nn.Linear`s by what a Tinker `LoraConfig` trains: attn, mlp, unembed."""
    out_emb = model.get_output_embeddings()
    kinds: dict[str, list[str]] = {"attn": [], "mlp": [], "unembed": []}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        parts = name.split(".")
        if m is out_emb:
            kinds["unembed"].append(name)
        elif any("attn" in p or "attention" in p for p in parts):
            kinds["attn"].append(name)
        elif any("mlp" in p or "feed_forward" in p for p in parts):
            kinds["mlp"].append(name)
    return kinds


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax of `logits` `[..., V]` gathered at `tokens` `[...]`, row by row as the engine's
    sampler computes it (so an invariant pass gives the sampler's bits)."""
    flat = logits.reshape(-1, logits.shape[-1]).float().log_softmax(dim=-1)
    return flat.gather(-1, tokens.reshape(-1, 1).long()).reshape(tokens.shape)


@dataclass
class Adapter:
    model_id: str
    name: str  # the PEFT adapter name
    rank: int
    targets: list[str]
    optimizer: torch.optim.Optimizer
    steps: int = 0
    passes: int = 0  # forward_backward calls since the last optim_step


class Trainer:
    """LoRA training clients on one base model (`base` is copied once; the engine keeps its own).

    Args:
        base: the base causal LM (float32 or bfloat16), in eval mode.
        invariant: run every pass through the batch-invariant ops (`page_size`: the engine's).
    """

    def __init__(self, base: torch.nn.Module, invariant: bool = False, page_size: int = 16) -> None:
        self.original = base  # NOTE: the engine's; never modified here
        self.base = copy.deepcopy(base).eval()
        self.kinds = linear_kinds(self.base)
        self.vocab = self.base.get_output_embeddings().weight.shape[0]
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.peft = None
        self.adapters: dict[str, Adapter] = {}
        self.invariant, self.page_size = invariant, page_size
        self._invariant_forward = None
        self.lock = threading.RLock()

    # ----------------------------------------------------------------- models
    def create(
        self,
        model_id: str,
        rank: int,
        seed: int | None = None,
        train_attn: bool = True,
        train_mlp: bool = True,
        train_unembed: bool = True,
    ) -> Adapter:
        from peft import LoraConfig, get_peft_model

        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise UserError(f"lora_config.rank must be a positive int, got {rank!r}")
        with self.lock:
            if model_id in self.adapters:
                raise UserError(f"model {model_id!r} exists already")
            targets = [
                n
                for kind, on in (("attn", train_attn), ("mlp", train_mlp), ("unembed", train_unembed))
                if on
                for n in self.kinds[kind]
            ]
            if not targets:
                raise UserError(
                    "lora_config trains no layer of this model (train_attn, train_mlp, train_unembed)"
                )
            config = LoraConfig(r=rank, lora_alpha=LORA_ALPHA, target_modules=targets, lora_dropout=0.0)
            name = f"m{len(self.adapters)}"
            with torch.random.fork_rng():
                torch.manual_seed(seed if seed is not None else torch.seed() % 2**63)
                if self.peft is None:
                    self.peft = get_peft_model(self.base, config, adapter_name=name).eval()
                else:
                    self.peft.add_adapter(name, config)
            self._invariant_forward = None  # NOTE: new modules: the invariant view is rebuilt
            params = self.params(name)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
            adapter = Adapter(model_id, name, rank, targets, opt)
            self.adapters[model_id] = adapter
            return adapter

    def base_model_copy(self) -> torch.nn.Module:
        """The base model as given (the caller copies it before changing anything)."""
        return self.original

    def get(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise UserError(f"unknown model_id {model_id!r} (create_model first)")
        return adapter

    def params(self, name: str) -> list[torch.nn.Parameter]:
        tag = f".{name}."
        return [p for n, p in self.peft.named_parameters() if "lora_" in n and tag in n]

    def state_dict(self, model_id: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors under PEFT's saved names (`...lora_A.weight`), detached copies."""
        from peft import get_peft_model_state_dict

        adapter = self.get(model_id)
        with self.lock:
            sd = get_peft_model_state_dict(self.peft, adapter_name=adapter.name, save_embedding_layers=False)
            return {k: v.detach().clone() for k, v in sd.items() if "lora_" in k}

    def adapter_tensors(self, model_id: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors under their full parameter names (`...lora_A.<adapter>.weight`), copies: a
        `PeftModel` with this one adapter (same name) on the same base takes them by name."""
        tag = f".{self.get(model_id).name}."
        with self.lock:
            return {
                n: p.detach().clone() for n, p in self.peft.named_parameters() if "lora_" in n and tag in n
            }

    def lora_config(self, model_id: str):
        return self.peft.peft_config[self.get(model_id).name]

    # ------------------------------------------------------------------ passes
    def _select(self, adapter: Adapter):
        self.peft.set_adapter(adapter.name)
        for p in self.params(adapter.name):  # NOTE: set_adapter freezes the others; this one trains
            p.requires_grad_(True)
        if not self.invariant:
            return self.peft
        if self._invariant_forward is None:
            from rollout.invariant.forward import InvariantForward

            self._invariant_forward = InvariantForward(self.peft, self.page_size)
        return self._invariant_forward

    def forward_backward(
        self, model_id: str, data: list[Datum], loss_fn: str, config: dict, forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """One pass over `data`; returns each datum's outputs (`logprobs`, `elementwise_loss`) and metrics."""
        adapter = self.get(model_id)
        if loss_fn not in LOSSES:
            raise UserError(f"loss_fn {loss_fn!r} is not supported (one of {', '.join(LOSSES)})")
        if not data:
            raise UserError("forward_backward got no data")
        vocab = self.vocab
        for i, d in enumerate(data):
            n = len(d.tokens)
            if n == 0:
                raise UserError(f"data[{i}]: model_input is empty")
            if min(d.tokens) < 0 or max(d.tokens) >= vocab:
                raise UserError(f"data[{i}]: model_input has token ids outside [0, {vocab})")
            for key in INPUTS[loss_fn]:
                if key not in d.inputs:
                    raise UserError(f"data[{i}]: loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]")
            for key, arr in d.inputs.items():
                if arr.reshape(-1).shape[0] != n:
                    raise UserError(
                        f"data[{i}]: loss_fn_inputs[{key!r}] has {arr.size} entries for {n} input "
                        "tokens (one per input token)"
                    )
            t = d.inputs["target_tokens"].reshape(-1)
            if t.min() < 0 or t.max() >= vocab:
                raise UserError(f"data[{i}]: target_tokens outside [0, {vocab})")
        low = float(config.get("clip_low_threshold", 0.8))
        high = float(config.get("clip_high_threshold", 1.2))
        with self.lock:
            forward = self._select(adapter)
            n_rows, width = len(data), max(len(d.tokens) for d in data)
            ids = torch.zeros(n_rows, width, dtype=torch.long)
            mask = torch.zeros(n_rows, width, dtype=torch.long)
            for i, d in enumerate(data):  # NOTE: right padding: a real token's positions start at 0
                ids[i, : len(d.tokens)] = torch.tensor(d.tokens)
                mask[i, : len(d.tokens)] = 1
            with torch.set_grad_enabled(not forward_only):
                logits = forward(input_ids=ids, attention_mask=mask).logits
                total = logits.new_zeros((), dtype=torch.float32)
                outputs = []
                for i, d in enumerate(data):
                    n = len(d.tokens)
                    target = torch.from_numpy(d.inputs["target_tokens"].reshape(-1).astype(np.int64))
                    logp = token_logprobs(logits[i, :n], target)
                    f = {
                        k: torch.from_numpy(v.reshape(-1).astype(np.float32))
                        for k, v in d.inputs.items()
                        if k != "target_tokens"
                    }
                    weights = f.get("weights", torch.ones(n))
                    if loss_fn == "cross_entropy":
                        per_token = -logp * weights
                    else:
                        ratio = torch.exp(logp - f["logprobs"])
                        adv = f["advantages"]
                        gain = (
                            ratio * adv
                            if loss_fn == "importance_sampling"
                            else torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
                        )
                        per_token = torch.where(weights != 0, -gain * weights, torch.zeros_like(gain))
                    total = total + per_token.sum()
                    outputs.append(
                        {
                            "logprobs": logp.detach().numpy().copy(),
                            "elementwise_loss": per_token.detach().numpy().copy(),
                        }
                    )
                if not forward_only:
                    if not math.isfinite(total.item()):
                        raise UserError(
                            f"the loss is not finite ({total.item()}): check logprobs / advantages"
                        )
                    total.backward()
                    adapter.passes += 1
        return outputs, {"loss:sum": float(total.item())}

    def optim_step(
        self,
        model_id: str,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        adapter = self.get(model_id)
        for key, v, ok in (
            ("learning_rate", lr, lr >= 0),
            ("beta1", beta1, 0 <= beta1 < 1),
            ("beta2", beta2, 0 <= beta2 < 1),
            ("eps", eps, eps >= 0),
            ("weight_decay", weight_decay, weight_decay >= 0),
            ("grad_clip_norm", grad_clip_norm, grad_clip_norm >= 0),
        ):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and ok):
                raise UserError(f"adam_params.{key} = {v!r} is out of range")
        with self.lock:
            params = self.params(adapter.name)
            grads = [p.grad for p in params if p.grad is not None]
            norm = (
                float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
                if grads
                else 0.0
            )
            if grad_clip_norm > 0 and grads:
                torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)
            for group in adapter.optimizer.param_groups:
                group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
            adapter.optimizer.step()
            adapter.optimizer.zero_grad(set_to_none=True)
            adapter.steps += 1
            adapter.passes = 0
        return {"grad_norm:mean": norm, "learning_rate:mean": float(lr)}

    # ------------------------------------------------------------- checkpoints
    def save(self, model_id: str, path: Path, optimizer: bool = True) -> None:
        """A PEFT directory (`adapter_config.json`, `adapter_model.safetensors`) plus `optimizer.pt`."""
        adapter = self.get(model_id)
        path.mkdir(parents=True, exist_ok=True)
        with self.lock:
            self.peft.save_pretrained(
                str(path), selected_adapters=[adapter.name], save_embedding_layers=False
            )
            sub = path / adapter.name  # NOTE: PEFT writes a named adapter into a subfolder
            if sub.is_dir():
                for f in sub.iterdir():
                    f.replace(path / f.name)
                sub.rmdir()
            if optimizer:
                torch.save(
                    {"optimizer": adapter.optimizer.state_dict(), "steps": adapter.steps},
                    path / "optimizer.pt",
                )
            (path / "tinker.json").write_text(
                json.dumps({"model_id": model_id, "rank": adapter.rank, "steps": adapter.steps})
            )

    def load(self, model_id: str, path: Path, optimizer: bool) -> None:
        """Load a `save` directory into `model_id`'s adapter (and its Adam state with `optimizer`)."""
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        adapter = self.get(model_id)
        if not (path / "adapter_config.json").is_file():
            raise UserError(f"no PEFT checkpoint at {path}")
        with self.lock:
            weights = load_peft_weights(str(path))
            result = set_peft_model_state_dict(self.peft, weights, adapter_name=adapter.name)
            missing = [k for k in result.unexpected_keys if "lora_" in k]
            if missing:
                raise UserError(f"checkpoint {path} does not fit model {model_id!r}: {missing[:3]}")
            if optimizer:
                if not (path / "optimizer.pt").is_file():
                    raise UserError(f"checkpoint {path} has no optimizer state")
                state = torch.load(path / "optimizer.pt", weights_only=True)
                adapter.optimizer.load_state_dict(state["optimizer"])
                adapter.steps = int(state["steps"])


def checkpoint_rank(path: Path) -> int:
    """The LoRA rank of a `Trainer.save` directory."""
    try:
        return int(json.loads((path / "adapter_config.json").read_text())["r"])
    except (OSError, KeyError, ValueError) as e:
        raise UserError(f"no PEFT checkpoint at {path}: {e}") from None
