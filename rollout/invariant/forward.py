"""A trainer's forward through the batch-invariant ops: the same bits as the engine's
(`ContinuousBatchingConfig(batch_invariant=True)`) for the same weights and tokens.

`InvariantForward(model, page_size, dtype)` holds a view of `model` (a structural copy sharing every
parameter and buffer, so gradients reach the model's own parameters) with the mode's ops installed
(`rollout.invariant.mode.install`) and its attention set to `padded_attention`. Called like the model on a
padded batch (`input_ids [N, L]`, `attention_mask [N, L]`, positions from the mask), each real token gets
exactly the engine's computation: linears over fixed row tiles, rotary tables, and attention through the
same per-row kernel over a page layout of the same `page_size` (padding is never read, so it cannot change
a real row's bits). `dtype` runs the forward on cast parameters (a bf16 engine copy of fp32 weights: the
casts are differentiable, so fp32 master weights still get gradients; that pass runs without activation
checkpointing, whose recomputation would see the fp32 parameters); autocast is off inside, since it would
change which dtype each op runs in. The user's model is never modified.

The attention's backward recomputes it with plain differentiable torch ops (`invariant_ops.reference_attention`).
"""

from __future__ import annotations

import copy
import itertools

import torch

from rollout.invariant.mode import install
from rollout.invariant.ops import attend_rows, reference_attention

ATTN_NAME = "rollout_invariant"


class PaddedRows:
    """The page layout of a padded batch for the per-row kernel: sequence n's position p lives at slot
    `(n * P + p // page_size) * page_size + p % page_size` (P pages per sequence, table row n).

    Args:
        mask: `[N, L]` 1 on real tokens (left or right padding; positions count real tokens).
        page_size: the engine's, so each row's keys split into pages exactly as in the engine.
    """

    def __init__(self, mask: torch.Tensor, page_size: int, kernels: str = "cpu") -> None:
        self.kernels = kernels  # NOTE: the attention's kernels (`rollout.invariant.ops.attend_rows`)
        self.valid = mask.bool()  # [N, L]
        n, length = self.valid.shape
        self.pos = (self.valid.long().cumsum(-1) - 1).clamp_min(0)  # [N, L] position of each column
        self.page_size = page_size
        pages = -(-length // page_size)
        dev = mask.device
        self.slots = torch.arange(n, device=dev)[:, None] * (pages * page_size) + self.pos  # [N, L]
        self.num_slots = n * pages * page_size
        self.table = torch.arange(n * pages, device=dev).view(n, pages)  # [N, P]
        self.row = torch.arange(n, device=dev).repeat_interleave(length)  # [N * L]

    def bounds(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, L] first key position, [N, L] one past the last) each column reads, as in the engine."""
        start = torch.zeros_like(self.pos) if window is None else (self.pos - (window - 1)).clamp_min(0)
        return start, self.pos + 1

    def allowed(self, window: int | None) -> torch.Tensor:
        """[N, 1, L, L] True where column i reads column j (the same keys as the kernel)."""
        start, end = self.bounds(window)
        kp = self.pos[:, None, :]  # [N, 1, L]
        ok = self.valid[:, None, :] & (kp < end[:, :, None]) & (kp >= start[:, :, None])
        return ok[:, None]

    def cache(self, x: torch.Tensor) -> torch.Tensor:
        """`x [N, Hkv, L, D]` laid out as a paged cache `[Hkv, slots, D]` (real tokens only)."""
        out = x.new_zeros(x.shape[1], self.num_slots, x.shape[3])
        out[:, self.slots[self.valid]] = x.permute(1, 0, 2, 3)[:, self.valid]
        return out


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rows: PaddedRows, window, scale, softcap):
        n, h, length, d = q.shape
        start, end = rows.bounds(window)
        q_rows = q.permute(0, 2, 1, 3).reshape(n * length, h, d)  # [N*L, H, D]
        out = attend_rows(
            q_rows,
            rows.cache(k.detach()),
            rows.cache(v.detach()),
            rows.table,
            rows.row,
            start.reshape(-1),
            end.reshape(-1),
            rows.page_size,
            scale,
            softcap,
            rows.kernels,
        )
        ctx.save_for_backward(q, k, v)
        ctx.rows, ctx.window, ctx.scale, ctx.softcap = rows, window, scale, softcap
        return out.view(n, length, h, d).to(q.dtype)  # [N, L, H, D]

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            ref = reference_attention(q, k, v, ctx.rows.allowed(ctx.window), ctx.scale, ctx.softcap)
            gq, gk, gv = torch.autograd.grad(ref, (q, k, v), grad.float())
        return gq, gk, gv, None, None, None, None


def padded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [N, H, L, D]
    key: torch.Tensor,  # [N, Hkv, L, D]
    value: torch.Tensor,  # [N, Hkv, L, D]
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    rollout_rows: PaddedRows | None = None,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([N, L, H, D], no weights)
    """The attention function registered as `ATTN_NAME`: the engine's per-row attention on a padded batch."""
    if rollout_rows is None:
        raise RuntimeError(
            f"attention '{ATTN_NAME}' runs only inside rollout.invariant.forward.InvariantForward"
        )
    if s_aux is not None:
        raise ValueError("batch_invariant: the per-row kernel does not implement attention sinks")
    if dropout:
        raise ValueError(
            f"batch_invariant: attention dropout {dropout} (disable dropout for the trainer's passes)"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _Attention.apply(query, key, value, rollout_rows, sliding_window or None, scale, softcap)
    return out, None


def register() -> str:
    """Register `padded_attention` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, padded_attention)
    return ATTN_NAME


class InvariantForward:
    """`model`'s forward through the mode's ops on padded batches (see the module docstring).

    Args:
        model: the trainer's module (a HF causal LM, or a wrapper holding one, e.g. a value-head model).
        page_size: the engine's `page_size`.
        dtype: the engine's dtype when it runs a cast copy (e.g. torch.bfloat16); None: the model's own.
        kernels: the engine's (`rollout.invariant.mode.kernels_for`): "cpu", "triton"; None: by the model's
            device ("triton" on CUDA).
    """

    def __init__(self, model: torch.nn.Module, page_size: int, dtype: torch.dtype | None = None,
                 kernels: str | None = None) -> None:
        from transformers import PreTrainedModel

        register()
        device = next(model.parameters()).device
        self.kernels = kernels or ("triton" if device.type == "cuda" else "cpu")
        self.model, self.page_size = model, page_size
        memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
        self.view = copy.deepcopy(model, memo)  # NOTE: modules and configs copied, tensors shared
        for module in self.view.modules():
            if isinstance(module, PreTrainedModel):
                if "forward" in vars(module) and "_hf_hook" not in vars(module):
                    del module.forward  # NOTE: accelerate's autocast wrapper: the mode runs one dtype
                module.set_attn_implementation(ATTN_NAME)
        install(self.view, self.kernels)
        own = next(model.parameters()).dtype
        self.dtype = dtype if dtype is not None and dtype != own else None
        if self.dtype is not None:
            # NOTE: a checkpointed layer recomputes in the backward, after `functional_call` has put the fp32
            # parameters back: the cast pass runs without activation checkpointing.
            for module in self.view.modules():
                if isinstance(module, PreTrainedModel) and getattr(
                    module, "is_gradient_checkpointing", False
                ):
                    module.gradient_checkpointing_disable()

    def __call__(self, **kwargs):
        mask = kwargs["attention_mask"]
        kwargs["rollout_rows"] = PaddedRows(mask, self.page_size, self.kernels)
        self.view.train(self.model.training)
        with torch.autocast(mask.device.type, enabled=False):
            if self.dtype is None:
                return self.view(**kwargs)
            tensors = {
                name: t.to(self.dtype) if t.is_floating_point() else t
                for name, t in itertools.chain(self.view.named_parameters(), self.view.named_buffers())
            }
            return torch.func.functional_call(self.view, tensors, (), kwargs)
