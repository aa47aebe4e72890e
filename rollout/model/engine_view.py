"""The engine view of a user's model: what the engine runs instead of the user's module.

A shallow structural copy that shares every parameter and buffer (so optimizer steps and weight updates
are seen at once) but has its own config set to our paged attention (`rollout.attention.interface`), its own eval
mode, no autograd, packed oneDNN linears and one-call RMSNorms, gated MLPs and attention projections + RoPE on a CPU
(`rollout.kernels.linear`, `rollout.kernels.fused_layers`, `rollout.kernels.fused_attention`), and the model class's own
forward even where the user's instance had it replaced. The user's own module keeps its attention
implementation, its train/eval mode and `requires_grad` untouched.
"""

from __future__ import annotations

import copy

import torch

from rollout.attention.interface import ATTN_NAME, register
from rollout.kernels.fused_attention import use_fused_attention
from rollout.kernels.fused_decoder import use_fused_decoder_layers, use_fused_decoder_models
from rollout.kernels.fused_layers import use_fused_layers
from rollout.kernels.linear import drop_packed, use_onednn_linears


def make_engine_view(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree sharing its parameters and buffers, running our attention."""
    register()
    memo: dict[int, object] = {}
    for t in (*model.parameters(), *model.buffers()):
        memo[id(t)] = t
    # NOTE: deepcopy with every tensor pre-seeded in the memo copies modules and configs only.
    view = copy.deepcopy(model, memo)
    for a, b in zip(model.parameters(), view.parameters(), strict=True):
        if a is not b:
            raise RuntimeError("engine view does not share parameters with the model")
    _drop_forward_overrides(view)
    use_onednn_linears(view)
    use_fused_layers(view)
    use_fused_attention(view)
    use_fused_decoder_layers(view)  # NOTE: after the two above: a layer is fused where its four children are
    use_fused_decoder_models(view)
    try:
        view.set_attn_implementation(ATTN_NAME)
    except Exception as e:  # pragma: no cover - depends on the architecture
        raise ValueError(
            f"{type(model).__name__} cannot run on rollout's paged attention: {e}. "
            "Only Hugging Face causal LMs that dispatch attention through AttentionInterface are supported."
        ) from e
    view.eval()
    return view


def drop_weight_copies(view: torch.nn.Module) -> int:
    """Forget the weight copies the view's routed linears keep (oneDNN's packed layout, the small-M panels,
    the compiled forward's); they are rebuilt from the current weights at the next step. Returns how many."""
    return drop_packed(view)


def _drop_forward_overrides(view: torch.nn.Module) -> None:
    """Run each model's class forward: drop `forward`s set on the view's model instances.

    TRL (`add_fused_lm_head`) and accelerate (mixed precision) replace `model.forward` on the instance
    with a wrapper; TRL's closes over the *original* module's bound forward, so the copied view would run
    the user's module with its own attention. accelerate's device hooks (`_hf_hook`) are kept.
    """
    from transformers import PreTrainedModel

    for module in view.modules():
        if isinstance(module, PreTrainedModel) and "forward" in vars(module) and "_hf_hook" not in vars(module):
            del module.forward
