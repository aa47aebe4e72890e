// One Llama-family decoder layer of a decode or verifying step in one call (issue 60: the few-row step).
//
// The Python path (`rollout.kernels.fused_decoder._layer_forward` -> the fused norms, attention and MLP) runs a
// dozen of this extension's kernels per layer with Python and torch glue between them; at 5M and 4 rows that glue
// was ~65% of a decode step (the step's kernel calls replayed back to back: 0.92 of 2.67 ms). This runs the same
// kernels, with the same arguments, in the same order, from C++:
//
//   h = rms_norm(x, in_w); q, k, v = small_linears(h, [q, k, v]); q, k = qk_norm_rope(q, k, ...)
//   write_kv(k, v at slots); a = cascade_decode_attention(q over the pages); x = x + small_linear(a, o)
//   h = rms_norm(x, post_w); g, u = small_linears(h, [gate, up]); x = x + small_linear(silu_mul(g, u), down)
//
// so a layer's output is bit for bit the Python path's (tests/kernels/test_fused_decoder.py). Only decode rows
// read in place (a decode-only step, a verifying step: every token a query of the paged kernel), fp32 everywhere,
// every linear on the small-M kernel (`rollout.kernels.linear`, up to SMALL_ROWS rows): the caller checks.
#include "kernels.h"

// panels / biases / ns: q, k, v, o, gate, up, down (`pack_panels` of each weight, its bias or none, its rows)
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& in_w, double in_eps, const at::Tensor& post_w,
                         double post_eps, const std::vector<at::Tensor>& panels,
                         const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<int64_t>& ns,
                         const c10::optional<at::Tensor>& q_norm_w, const c10::optional<at::Tensor>& k_norm_w,
                         double q_eps, double k_eps, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slots, const at::Tensor& table, const at::Tensor& row,
                         const at::Tensor& start, const at::Tensor& end, int64_t page_size, double scale,
                         const c10::optional<at::Tensor>& alias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "decoder_layer: x is [T, E] fp32");
  TORCH_CHECK(panels.size() == 7 && biases.size() == 7 && ns.size() == 7,
              "decoder_layer: panels, biases and ns of q, k, v, o, gate, up, down");
  const int64_t T = x.size(0), D = head_dim;
  const auto h = rms_norm(x, in_w, in_eps);
  const auto qkv = small_linears(h, {panels[0], panels[1], panels[2]}, {biases[0], biases[1], biases[2]},
                                 {ns[0], ns[1], ns[2]});
  const auto [q, k] = qk_norm_rope(qkv[0], qkv[1], q_norm_w, k_norm_w, q_eps, k_eps, cos, sin, D);
  write_kv(k_cache, v_cache, slots, k.view({T, kv_heads, D}).transpose(0, 1), qkv[2].view({T, kv_heads, D}).transpose(0, 1));
  auto attn = at::empty({T, heads, D}, x.options());
  cascade_decode_attention(q.view({T, heads, D}).contiguous(), k_cache, v_cache, table, row, start, end, page_size,
                           scale, 0.0, attn, alias);
  const auto mid = x + small_linear(attn.view({T, heads * D}), panels[3], biases[3], ns[3]);
  const auto h2 = rms_norm(mid, post_w, post_eps);
  const auto gu = small_linears(h2, {panels[4], panels[5]}, {biases[4], biases[5]}, {ns[4], ns[5]});
  return mid + small_linear(silu_mul(gu[0], gu[1]), panels[6], biases[6], ns[6]);
}
