"""LoRA adapters as the engine reads them: per base linear, A [r, in], B [out, r] and the scale PEFT applies.

Three sources, one result (`LoraWeights`):

- a PEFT `PeftModel` (or its `LoraModel`): read from its LoRA layers (`lora_A` / `lora_B` / `scaling` of the
  adapter named, default the active one), no copy made here;
- a PEFT state dict (`get_peft_model_state_dict`, or the model's own `state_dict()` keys) with its `LoraConfig`
  (or that config's dict);
- a directory saved with `save_pretrained` (`adapter_config.json` and `adapter_model.safetensors` or `.bin`),
  read without PEFT installed.

The scale is PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA, `r` and `alpha` taken per module
from `rank_pattern` / `alpha_pattern` as PEFT matches them. What cannot run as an unmerged low-rank product
beside a plain linear is a ValueError naming it: DoRA, LoRA on embeddings or convolutions, adapter biases,
`modules_to_save`, `fan_in_fan_out` (GPT-2's Conv1D), another PEFT method.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."  # NOTE: PEFT's names for the base model's modules start with it
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class LoraModule:
    """One base linear's adapter: `delta(x) = scale * (x @ a.T) @ b.T`."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraWeights:
    """An adapter read from any source: its low-rank pair per base module name (the base model's own names,
    e.g. `model.layers.0.self_attn.q_proj`)."""

    modules: dict[str, LoraModule]

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


def is_peft_model(obj) -> bool:
    """Whether `obj` is a PEFT model (`PeftModel` or a tuner model): it carries `peft_config` by adapter name."""
    return isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "peft_config", None), dict)


def read_adapter(adapter, config=None, adapter_name: str | None = None) -> LoraWeights:
    """`adapter` (a PeftModel, a PEFT state dict with `config`, a `(state_dict, config)` pair, or a directory)
    as `LoraWeights`; ValueError naming what cannot be read or run."""
    if is_peft_model(adapter):
        return _from_peft_model(adapter, adapter_name)
    if isinstance(adapter, tuple) and len(adapter) == 2 and config is None:
        adapter, config = adapter
    if isinstance(adapter, (str, Path)):
        return _from_directory(Path(adapter))
    if isinstance(adapter, dict):
        if config is None:
            raise ValueError("a LoRA state dict needs its LoraConfig: pass config= (or a (state_dict, config) pair)")
        return from_state_dict(adapter, _config_dict(config))
    raise ValueError(f"adapter must be a PeftModel, a PEFT state dict with its LoraConfig, or a directory saved "
                     f"with save_pretrained; got {type(adapter).__name__}")


def _config_dict(config) -> dict:
    if isinstance(config, dict):
        return dict(config)
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    raise ValueError(f"config must be a peft LoraConfig or its dict, got {type(config).__name__}")


# NOTE: the LoraConfig fields rollout reads (a pushed adapter's config travels as these, JSON-safe)
CONFIG_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "use_dora",
                 "modules_to_save", "fan_in_fan_out", "lora_bias", "bias", "trainable_token_indices")


def config_fields(config) -> dict:
    """The fields of a LoraConfig (or its dict) that rollout reads, as plain JSON values."""
    out = {}
    for name, value in _config_dict(config).items():
        if name in CONFIG_FIELDS:
            value = getattr(value, "value", value)  # NOTE: PeftType is an enum
            out[name] = sorted(value) if isinstance(value, (set, frozenset)) else value
    return out


def as_state_dict(adapter, config=None) -> tuple[dict[str, torch.Tensor], dict]:
    """An adapter (any `read_adapter` source) as a PEFT-style state dict and its config fields, for a push: the
    PeftModel's own scale is kept exact by sending each module's alpha (`alpha_pattern`) beside its rank."""
    weights = read_adapter(adapter, config)
    state = {}
    for module, m in weights.modules.items():
        state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"] = m.a, m.b
    alphas = {re.escape(module): m.scale * m.rank for module, m in weights.modules.items()}
    return state, {"peft_type": "LORA", "lora_alpha": 1.0, "alpha_pattern": alphas}


def _check_config(config: dict, where: str) -> None:
    """Refuse what rollout's unmerged product does not compute, by the config field that asks for it."""
    peft_type = str(getattr(config.get("peft_type"), "value", config.get("peft_type") or "LORA"))
    if peft_type.upper() != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not LoRA (rollout serves LoRA adapters only)")
    refused = {
        "use_dora": "DoRA (use_dora=True) is not supported: merge it, or train plain LoRA",
        "modules_to_save": "modules_to_save (fully trained copies of base modules) is not supported",
        "fan_in_fan_out": "fan_in_fan_out=True (Conv1D weights, GPT-2) is not supported",
        "lora_bias": "lora_bias=True (a bias on lora_B) is not supported",
        "trainable_token_indices": "trainable_token_indices is not supported",
    }
    for name, why in refused.items():
        if config.get(name):
            raise ValueError(f"{where}: {why}")
    if config.get("bias", "none") not in ("none", None):
        raise ValueError(f"{where}: bias={config['bias']!r} trains base biases; rollout serves bias='none' only")


def _pattern(patterns: dict, module: str):
    """PEFT's `get_pattern_key` match: the first key that equals a dotted suffix of `module` (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def scale_of(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of `module`'s adapter of rank `rank`."""
    alpha = _pattern(config.get("alpha_pattern"), module)
    alpha = config.get("lora_alpha", 8) if alpha is None else alpha
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


# NOTE: `<module>.lora_A.weight` (get_peft_model_state_dict, save_pretrained) or `<module>.lora_A.<adapter>.weight`
# (the PeftModel's own state_dict)
_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                  r"(?:\.(?P<adapter>[^.]+))?\.weight$")


def from_state_dict(state: dict[str, torch.Tensor], config: dict, where: str = "LoRA state dict") -> LoraWeights:
    """A PEFT state dict (keys `base_model.model.<module>.lora_A.weight`, ...) and its config's dict."""
    _check_config(config, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"{where}: {key!r} is not a LoRA tensor (expected <module>.lora_A.weight / .lora_B.weight)"
            )
        part = m["part"]
        if part == "lora_magnitude_vector":
            raise ValueError(f"{where}: {key!r} is a DoRA magnitude; DoRA is not supported")
        if part.startswith("lora_embedding"):
            raise ValueError(f"{where}: {key!r} is an embedding adapter; rollout runs LoRA on linear layers only")
        module = m["module"].removeprefix(PEFT_PREFIX)
        pairs.setdefault(module, {})[part] = value
    if not pairs:
        raise ValueError(f"{where} holds no LoRA tensors")
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{where}: module {module!r} has {sorted(pair)}, needs both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{where}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                             "a linear's LoRA is A [r, in] and B [out, r] (convolutions are not supported)")
        modules[module] = LoraModule(a.detach(), b.detach(), scale_of(config, module, a.shape[0]))
    return LoraWeights(modules)


def _from_directory(path: Path) -> LoraWeights:
    where = f"LoRA directory {str(path)!r}"
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{where} has no {CONFIG_FILE} (save the adapter with PeftModel.save_pretrained)")
    config = json.loads((path / CONFIG_FILE).read_text())
    weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if weights is None:
        raise ValueError(f"{where} has none of {list(WEIGHT_FILES)}")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file  # noqa: PLC0415 - a dependency of transformers

        state = load_file(str(weights))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    return from_state_dict(state, config, where)


def _from_peft_model(model: torch.nn.Module, adapter_name: str | None) -> LoraWeights:
    """The adapter's tensors as the PeftModel's LoRA layers hold them (their live parameters, not copies)."""
    name = adapter_name or active_adapter(model)
    if name not in model.peft_config:
        raise ValueError(f"the PeftModel has no adapter {name!r} (it has {sorted(model.peft_config)})")
    where = f"PeftModel adapter {name!r}"
    # NOTE: a PeftModel names the base's modules `base_model.model.<name>`, its LoraModel `model.<name>`
    prefix = PEFT_PREFIX if isinstance(getattr(model, "base_model", None), torch.nn.Module) else "model."
    _check_config(_config_dict(model.peft_config[name]), where)
    modules = {}
    for module_name, module in model.named_modules():
        for part in ("lora_embedding_A", "lora_magnitude_vector"):
            if name in (getattr(module, part, None) or {}):
                raise ValueError(f"{where}: {module_name} has {part}: only plain LoRA on linear layers is supported")
        if name not in (getattr(module, "lora_A", None) or {}):
            continue
        base = getattr(module, "base_layer", None)
        if type(base) is not torch.nn.Linear:
            raise ValueError(f"{where}: {module_name} adapts a {type(base).__name__}; rollout runs LoRA on "
                             "torch.nn.Linear layers only")
        if getattr(module, "lora_bias", {}).get(name):
            raise ValueError(f"{where}: {module_name} has lora_bias=True, which is not supported")
        a, b = module.lora_A[name].weight, module.lora_B[name].weight
        modules[module_name.removeprefix(prefix)] = LoraModule(a.detach(), b.detach(), float(module.scaling[name]))
    if not modules:
        raise ValueError(f"{where} adapts no linear layer")
    return LoraWeights(modules)


def active_adapter(model: torch.nn.Module) -> str:
    """The PeftModel's one active adapter's name (ValueError with several)."""
    active = getattr(model, "active_adapter", None)
    if isinstance(active, (list, tuple)):
        if len(active) != 1:
            raise ValueError(f"the PeftModel has several active adapters {list(active)}: pass adapter_name=")
        active = active[0]
    return active or next(iter(model.peft_config))

