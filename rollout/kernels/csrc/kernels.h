// rollout's CPU kernels: the entry points `module.cpp` binds (one extension, built by rollout/kernels/cpu_kernels.py).
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

// decode_attention.cpp
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                            const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size,
                            double scale, double softcap, at::Tensor& out, const c10::optional<at::Tensor>& alias);
void cascade_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                              const at::Tensor& row, const at::Tensor& start, const at::Tensor& end,
                              int64_t page_size, double scale, double softcap, at::Tensor& out,
                              const c10::optional<at::Tensor>& alias);
std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>, int64_t, int64_t>> cascade_plan(
    const at::Tensor& table, const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size,
    const c10::optional<at::Tensor>& alias);
int64_t parallel_threads(int64_t items);

// small_gemm.cpp
bool small_gemm_available();
at::Tensor pack_panels(const at::Tensor& w);
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                        int64_t N);
std::vector<at::Tensor> small_linears(const at::Tensor& x, const std::vector<at::Tensor>& panels,
                                      const std::vector<c10::optional<at::Tensor>>& biases,
                                      const std::vector<int64_t>& Ns);

// rms_norm.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k,
                                               const c10::optional<at::Tensor>& q_weight,
                                               const c10::optional<at::Tensor>& k_weight, double q_eps, double k_eps,
                                               const at::Tensor& cos, const at::Tensor& sin, int64_t D);

// kv_write.cpp
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& key,
              const at::Tensor& value);

// silu_mul.cpp
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);
std::vector<double> greedy_verify(const at::Tensor& logits, const std::vector<int64_t>& lens,
                                  const std::vector<int64_t>& drafts, bool logprobs);

// decoder_layer.cpp
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& in_w, double in_eps, const at::Tensor& post_w,
                         double post_eps, const std::vector<at::Tensor>& panels,
                         const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<int64_t>& ns,
                         const c10::optional<at::Tensor>& q_norm_w, const c10::optional<at::Tensor>& k_norm_w,
                         double q_eps, double k_eps, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slots, const at::Tensor& table, const at::Tensor& row,
                         const at::Tensor& start, const at::Tensor& end, int64_t page_size, double scale,
                         const c10::optional<at::Tensor>& alias);

// suffix_drafts.cpp
void bind_suffix_drafts(pybind11::module& m);
