"""The `triton` attention backend: decode rows through the Triton paged kernel, prompt chunks through SDPA.

The GPU shape of the `cpu` backend: the same metadata (`rollout.attention.backends.cpu.build_cpu_group`: each
decode row's page-table row and [start, end) of positions, read in place over the paged cache), attended by
`rollout.kernels.triton_decode.paged_decode_attention` instead of the C++ kernel, with gpt-oss's attention sinks;
prompt chunks take the `sdpa` backend's segments. Runs on CUDA, and on a CPU under Triton's interpreter
(`TRITON_INTERPRET=1` before triton is imported: the tests' exactness path, slow). Chosen by name only: `"auto"`
never picks it. Needs the `triton` extra (`pip install 'rollout[triton]'`); without it `attn_backend='triton'` is a
ValueError naming the extra.
"""

from __future__ import annotations

import importlib

import torch

from rollout.attention.backends.cpu import DTYPES, CpuBackend, CpuGroupMetadata
from rollout.attention.backends.sdpa import attend_gathered


def triton_attend(kernel, meta, group: CpuGroupMetadata, query, key, value, k_cache, v_cache, scale: float,
                  softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:  # [T, H, D]
    """Kernel rows in place over the pages, then `sdpa`'s prompt segments (`query` [1, H, T, D])."""
    q_rows = query[0].transpose(0, 1)  # [T, H, D]
    out = q_rows.new_empty(q_rows.shape)  # [T, H, D]
    pd = group.paged
    if pd is not None:  # NOTE: forks' aliases are a cascade-only shortcut: each row reads its own copy here
        cap = float(softcap or 0.0)
        if pd.all_rows:  # NOTE: a decode-only step: every packed row, written in place
            kernel(q_rows, k_cache, v_cache, pd.table, pd.row, pd.start, pd.end, meta.cache.page_size, scale, cap,
                   out, sinks)
        else:
            q = q_rows.index_select(0, pd.rows)  # [n, H, D]
            o = torch.empty_like(q)
            kernel(q, k_cache, v_cache, pd.table, pd.row, pd.start, pd.end, meta.cache.page_size, scale, cap, o,
                   sinks)
            out.index_copy_(0, pd.rows, o)
    attend_gathered(out, q_rows, group, key, value, k_cache, v_cache, scale, softcap, sinks)
    return out


class TritonBackend(CpuBackend):
    """The `cpu` backend's metadata and memory plan, decode rows sent to the Triton kernel (see the module
    docstring)."""

    name = "triton"
    supports_sinks = True  # NOTE: the kernel's sink term; prompt chunks use `sdpa`'s explicit softmax

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, **_) -> TritonBackend:
        try:
            triton_decode = importlib.import_module("rollout.kernels.triton_decode")
        except ImportError as e:
            raise ValueError(f"attn_backend='triton' needs the triton extra ({e}); "
                             "pip install 'rollout[triton]', or use attn_backend='auto'") from e
        if dtype not in DTYPES:
            raise ValueError(f"attn_backend='triton' supports fp32, bf16 and fp16 caches, got {dtype}")
        if not triton_decode.available(device):
            raise ValueError(f"attn_backend='triton' runs on CUDA (or on a CPU under Triton's interpreter, "
                             f"TRITON_INTERPRET=1, for tests); the model is on {device}")
        return cls(triton_decode.paged_decode_attention)

    def attend(self, meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return triton_attend(self.kernel, meta, group, query, key, value, k_cache, v_cache, scale, softcap, sinks)
