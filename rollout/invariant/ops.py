"""The batch-invariant ops (`ContinuousBatchingConfig(batch_invariant=True)`): each computes a row's result
with one reduction order whatever else is in the batch, so the engine (packed `[1, T]` steps of any mix)
and a trainer (padded `[N, L]` batches) get the same bits for the same token.

- `tiled_linear`: a linear over fixed tiles of `TILE` rows. A CPU GEMM picks its kernel and blocking from
  the row count M (MKL's fp32 sgemm gives a row other bits at M = 1, 2, 3, 5 ... than at M = 16, measured),
  so the rows are padded to a multiple of `TILE` and run as one `bmm` of identical `[TILE, K] x [K, N]`
  GEMMs: a row's bits then depend only on its own input (measured: the same at every position of a tile,
  for any tile count, fp32 and bf16). Faster paths measured row-invariant once the rows are padded to a
  multiple of `TILE` (every M from 16 to 2048, 1 and 2 threads, the tiny, 5M and 100M shapes) are taken
  where they exist: fp32 nn.Linear weights through oneDNN on its packed layout (the default engine's
  linears; only M = 1 differs there), bf16 through oneDNN's GEMM (10x faster than a bf16 `bmm` of tiles);
  `tests/invariant/test_batch_invariant.py` rechecks both on the machine that runs it. Its backward is the ordinary one
  (correct, not invariant: nothing compares gradients bitwise).
- `RotaryTable`: the cos / sin of a rotary embedding for every position up to the model's context, computed
  once by the module's own forward and then gathered by position. An elementwise `cos` on a CPU runs a
  vector body and a scalar tail, so the bits of a position computed on the fly depend on how many other
  positions share the call; a gather does not.
- `attend_rows`: attention of query rows, each over its own keys `[start, end)` read through page tables,
  by rollout's C++ per-row kernel (`rollout.kernels.cpu_kernels.paged_decode_attention`): one (row, KV head) per
  thread, keys scored page by page in position order, one softmax and one value sum in key order. The same
  call serves prompt rows, decode rows and a trainer's padded rows, so a token's attention has one
  reduction order however it is scheduled. Its backward recomputes the attention with differentiable torch
  ops (`reference_attention`).

Row-local ops not replaced (RMSNorm / LayerNorm reductions over the hidden size, activations, the
log-softmax of the logits) were measured row-invariant here; tests/invariant/test_batch_invariant.py checks the whole
forward end to end.

`kernels="triton"` (the GPU path: CUDA, or a CPU under Triton's interpreter for tests) runs the same ops through
Triton instead: linears through `rollout.kernels.triton_invariant.linear` (fixed output tiles, no split-K),
RMSNorm through its `rms_norm` (one program per row; `triton_rms_norm_forward`, installed by
`rollout.invariant.mode.install`), attention through `rollout.kernels.triton_decode` per row (one program per
token and KV head). tests/invariant/test_triton_invariant.py checks it under the interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.kernels import cpu_kernels
from rollout.kernels.linear import onednn_available

TILE = 16  # NOTE: rows per GEMM tile; every linear of the mode runs [TILE, K] x [K, N] products only


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: dict | None,
                kernels: str = "cpu"):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias, cache, kernels)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # [M, N]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight.to(g.dtype)).view(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb, None, None


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: dict | None,
             kernels: str) -> torch.Tensor:
    if kernels == "triton":
        return triton_kernels().linear(x, weight, bias)
    return _tiled(x, weight, bias, cache)


def triton_kernels():
    """`rollout.kernels.triton_invariant` (the GPU path's linears and RMSNorm); imported on first use."""
    import importlib

    return importlib.import_module("rollout.kernels.triton_invariant")


def _tiled(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: dict | None = None
) -> torch.Tensor:
    k, n = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, k)  # [M, K]
    m = rows.shape[0]
    pad = (-m) % TILE
    if pad:  # NOTE: zero rows fill the last tile; their outputs are dropped
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    if rows.dtype == torch.bfloat16:  # NOTE: oneDNN's bf16 GEMM: row-invariant at any M (measured), and a
        out = F.linear(rows, weight)[:m]  # bmm of tiles falls off its fast path (~10x slower at 2048 rows)
    elif cache is not None and onednn_available():  # NOTE: oneDNN on its packed layout, as the default engine
        out = torch.ops.mkldnn._linear_pointwise(
            rows.contiguous(), _packed(weight, cache), None, "none", [], ""
        )[:m]
    else:
        tiles = rows.shape[0] // TILE
        out = torch.bmm(rows.view(tiles, TILE, k), weight.t().expand(tiles, k, n))  # [tiles, TILE, N]
        out = out.view(-1, n)[:m]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


def _packed(weight: torch.Tensor, cache: dict) -> torch.Tensor:
    """`weight` in oneDNN's packed layout, packed again after an in-place change (version) or a new storage."""
    key = (weight.data_ptr(), weight._version, weight.shape)
    if cache.get("key") != key:
        cache["packed"] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), TILE)
        cache["key"] = key
    return cache["packed"]


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cache: dict | None = None,
    kernels: str = "cpu",
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with each row's bits independent of the other rows (see the docstring).

    `cache`: a dict the caller keeps per weight (a module's), holding fp32 weights' oneDNN packed copy; without
    it fp32 rows run as a bmm of tiles (other bits than the packed path: a model runs one or the other).
    `kernels`: "cpu" (the above) or "triton" (the GPU path's Triton GEMM)."""
    if x.dtype != weight.dtype:
        raise ValueError(
            f"batch_invariant: a linear got {x.dtype} inputs for {weight.dtype} weights (autocast or a "
            "mixed-dtype model); the mode runs one dtype end to end"
        )
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _TiledLinear.apply(x, weight, bias, cache, kernels)
    return _forward(x, weight, bias, cache, kernels)


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An `nn.Linear.forward` through `tiled_linear` (bound to a module with `types.MethodType`)."""
    return tiled_linear(x, self.weight, self.bias, self._rollout_invariant_packed, self._rollout_invariant_kernels)


def conv1d_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' `Conv1D.forward` (GPT-2: a linear with its weight stored `[in, out]`) through `tiled_linear`."""
    return tiled_linear(x, self.weight.t(), self.bias, kernels=getattr(self, "_rollout_invariant_kernels", "cpu"))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset = eps, offset
        return triton_kernels().rms_norm(x, weight, eps, offset)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # NOTE: the ordinary backward (correct, not invariant)
        x, weight = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            ref = reference_rms_norm(x, weight, ctx.eps, ctx.offset)
            gx, gw = torch.autograd.grad(ref, (x, weight), grad)
        return gx, gw, None, None


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm in torch ops (HF's Llama / Gemma forms): the backward of the Triton one."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def triton_rms_norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's forward through the Triton kernel (bound with `types.MethodType` by `install`)."""
    eps, offset = self._rollout_invariant_norm
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        return _RMSNorm.apply(x, self.weight, eps, offset)
    return triton_kernels().rms_norm(x, self.weight, eps, offset)


class RotaryTable:
    """cos / sin of a rotary embedding module for positions 0 .. `length - 1`, gathered by position.

    Rebuilt when the module's `inv_freq` changes (a weight load); `length` is the model's context.
    """

    def __init__(self, module: torch.nn.Module, length: int) -> None:
        rope = str(getattr(module, "rope_type", "default"))
        if "dynamic" in rope or "longrope" in rope:
            raise ValueError(
                f"batch_invariant: rope_type {rope!r} changes its frequencies with the sequence length; "
                "the mode supports fixed rotary frequencies only"
            )
        self.forward = type(module).forward.__get__(module)
        self.module, self.length = module, length
        self.key = None
        self.cos = self.sin = None

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        inv = (
            self.module.inv_freq
        )  # NOTE: keyed by value: a cast copy (a bf16 trainer pass) hits the same table
        key = (inv.dtype, x.device, tuple(inv.float().tolist()))
        if key != self.key:
            with torch.no_grad():
                pos = torch.arange(self.length, device=x.device)[None]  # [1, Lmax]
                cos, sin = self.forward(x.new_zeros((), dtype=torch.float32).expand(1, 1, 1), pos)
            self.cos, self.sin, self.key = cos[0], sin[0], key  # [Lmax, D] fp32
        if int(position_ids.max()) >= self.length:
            raise ValueError(
                f"batch_invariant: position {int(position_ids.max())} is past the model's context "
                f"({self.length})"
            )
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def kernel():
    """The per-row paged attention kernel, or None when it cannot build here."""
    return cpu_kernels.paged_decode_attention()


def attend_rows(
    q: torch.Tensor,  # [n, H, D] any float dtype
    k_cache: torch.Tensor,  # [Hkv, S, D] fp32, bf16 or fp16
    v_cache: torch.Tensor,  # [Hkv, S, D]
    table: torch.Tensor,  # [R, P] int32 or int64 page tables
    row: torch.Tensor,  # [n] table row of each query
    start: torch.Tensor,  # [n] first key position read
    end: torch.Tensor,  # [n] one past the last key position read
    page_size: int,
    scale: float,
    softcap: float | None,
    kernels: str = "cpu",
) -> torch.Tensor:  # [n, H, D] fp32
    """Each query row attends its own keys `[start, end)` with one fixed reduction order (see the docstring);
    `kernels="triton"`: through the Triton per-row kernel (`rollout.kernels.triton_decode`)."""
    if kernels == "triton":
        import importlib

        run = importlib.import_module("rollout.kernels.triton_decode").paged_decode_attention
        qf = q.float().contiguous()
        out = torch.empty_like(qf)
        return run(qf, k_cache, v_cache, table.contiguous(), row.contiguous(), start.contiguous(), end.contiguous(),
                   page_size, float(scale), float(softcap or 0.0), out)
    run = kernel()
    if run is None:
        raise RuntimeError(
            "batch_invariant needs rollout's C++ CPU attention kernel, which is unavailable here"
        )
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    run(
        qf,
        k_cache,
        v_cache,
        table.contiguous(),
        row.long().contiguous(),
        start.long().contiguous(),
        end.long().contiguous(),
        page_size,
        float(scale),
        float(softcap or 0.0),
        out,
    )
    return out


def reference_attention(
    q: torch.Tensor,  # [N, H, L, D]
    k: torch.Tensor,  # [N, Hkv, L, D]
    v: torch.Tensor,  # [N, Hkv, L, D]
    allowed: torch.Tensor,  # [N, 1, L, L] bool, True where query i may read key j
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [N, L, H, D] fp32
    """The same attention in plain differentiable torch ops (fp32): the backward of the mode's attention."""
    if not softcap:  # NOTE: torch's fused CPU attention: no [N, H, L, L] probabilities kept for the backward
        out = F.scaled_dot_product_attention(
            q.float(),
            k.float(),
            v.float(),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.transpose(1, 2)
    g = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # [N, H, L, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.matmul(p, vf).transpose(1, 2)
