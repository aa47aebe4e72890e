// RMSNorm in one call for fp32 CPU tensors: y = weight * (x * rsqrt(mean(x^2, -1) + eps)).
//
// transformers' Llama-family RMSNorm runs six tensor ops (to, pow, mean, add, rsqrt, mul, mul); a decode step of
// a 12-layer Qwen3 runs 49 of them (two per layer, q_norm and k_norm per head, the final norm), each on a few
// rows, where the per-op dispatch is most of the cost. This is the same computation in one pass per row, with
// the same roundings in the same order, bit for bit: x * x rounded, then summed in the order of ATen's
// `cascade_sum` for a contiguous inner reduction (`sum_of_squares` below: 8-lane partial sums in 4 interleaved
// chains, cascaded in levels, then the lanes in order; torch's mean is that sum / H), 1 / sqrt(mean + eps),
// x * r, then weight * that.

// NOTE: no fused multiply-adds in this file: x * x must round before it is summed, as in torch
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <array>
#include <cmath>

namespace {

constexpr int64_t MAX_HEAD_DIM = 1024;  // qk_norm_rope's stack buffer
constexpr int LANES = 8;  // NOTE: the width of ATen's fp32 reduction vectors (its AVX2 kernel), measured equal

using Lanes = std::array<float, LANES>;

inline void add(Lanes& a, const Lanes& b) {
  for (int l = 0; l < LANES; ++l) a[l] += b[l];
}

inline Lanes squares(const float* x) {
  Lanes v;
  for (int l = 0; l < LANES; ++l) v[l] = x[l] * x[l];
  return v;
}

int64_t ceil_log2(int64_t x) {
  int64_t r = 0;
  while ((int64_t{1} << r) < x) ++r;
  return r;
}

// ATen's multi_row_sum<Vectorized<float>, 4> over `size` groups of 4 vectors (SumKernel.cpp), on x * x
std::array<Lanes, 4> multi_row_sum(const float* x, int64_t size) {
  constexpr int64_t levels = 4, rows = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  std::array<std::array<Lanes, rows>, levels> acc{};
  int64_t i = 0;
  for (; i + step <= size;) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < rows; ++k) add(acc[0][k], squares(x + (i * rows + k) * LANES));
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < rows; ++k) {
        add(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Lanes{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < rows; ++k) add(acc[0][k], squares(x + (i * rows + k) * LANES));
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < rows; ++k) add(acc[0][k], acc[j][k]);
  return acc[0];
}

// torch's x.pow(2).sum(-1) of one contiguous row, bit for bit (vectorized_inner_sum + row_sum)
float sum_of_squares(const float* x, int64_t n) {
  const int64_t vecs = n / LANES, groups = vecs / 4;
  auto partial = multi_row_sum(x, groups);
  for (int64_t i = groups * 4; i < vecs; ++i) add(partial[0], squares(x + i * LANES));
  for (int k = 1; k < 4; ++k) add(partial[0], partial[k]);
  float total = 0.f;
  for (int64_t k = vecs * LANES; k < n; ++k) total += x[k] * x[k];
  for (int l = 0; l < LANES; ++l) total += partial[0][l];
  return total;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  weight.device().is_cpu(),
              "rms_norm: fp32 CPU tensors");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(),
              "rms_norm: weight must be [H] with H the last dim of x");
  const auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  const int64_t rows = H == 0 ? 0 : xc.numel() / H;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // NOTE: one thread below ~32K elements (a decode step's rows): the team's wake-up costs more than the work
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = xp + r * H;
      float* o = yp + r * H;
      const float inv = 1.f / std::sqrt(sum_of_squares(a, H) / static_cast<float>(H) + e);
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 vi = _mm512_set1_ps(inv);
      for (; i + 16 <= H; i += 16) {
        const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(a + i), vi);
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(wp + i), t));
      }
#endif
      for (; i < H; ++i) o[i] = wp[i] * (a[i] * inv);
    }
  });
  return y;
}

// The query and key heads of a Llama-family attention after their projections, in one call: each head of
// q [rows, H * D] and k [rows, Hkv * D] optionally RMS-normed over D (Qwen3's q_norm / k_norm: `weight * (x * r)`
// as `rms_norm` above, bit for bit), then rotated (transformers' `apply_rotary_pos_emb`: x * cos + rotate_half(x)
// * sin with rotate_half(x) = cat(-x2, x1), the same products and sum in the same order: bit for bit), with
// cos / sin [rows, D] per row. Returns (q [rows, H, D], k [rows, Hkv, D]), contiguous.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k,
                                               const c10::optional<at::Tensor>& q_weight,
                                               const c10::optional<at::Tensor>& k_weight, double q_eps, double k_eps,
                                               const at::Tensor& cos, const at::Tensor& sin, int64_t D) {
  TORCH_CHECK(D > 0 && D % 2 == 0 && D <= MAX_HEAD_DIM, "qk_norm_rope: head_dim must be even and at most ",
              MAX_HEAD_DIM);
  for (const at::Tensor* t : {&q, &k, &cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(1) == 1,
                "qk_norm_rope: q, k, cos, sin are 2-D fp32 CPU tensors with unit inner stride");
  const int64_t rows = q.size(0);
  TORCH_CHECK(k.size(0) == rows && cos.size(0) == rows && sin.size(0) == rows && cos.size(1) == D &&
                  sin.size(1) == D && q.size(1) % D == 0 && k.size(1) % D == 0,
              "qk_norm_rope: q [rows, H * D], k [rows, Hkv * D], cos and sin [rows, D]");
  const float* wq = nullptr;
  const float* wk = nullptr;
  for (auto [w, p] : {std::pair{&q_weight, &wq}, std::pair{&k_weight, &wk}}) {
    if (w->has_value() && (*w)->defined()) {
      TORCH_CHECK((*w)->dim() == 1 && (*w)->size(0) == D && (*w)->scalar_type() == at::kFloat &&
                      (*w)->is_contiguous() && (*w)->device().is_cpu(),
                  "qk_norm_rope: norm weights are [D] fp32");
      *p = (*w)->data_ptr<float>();
    }
  }
  const int64_t H = q.size(1) / D, Hk = k.size(1) / D, half = D / 2;
  auto qo = at::empty({rows, H, D}, q.options());
  auto ko = at::empty({rows, Hk, D}, k.options());
  const float eq = static_cast<float>(q_eps), ek = static_cast<float>(k_eps);
  // one head: x [D] -> o [D], normed into a stack buffer first (rotation reads both halves)
  auto head = [&](const float* x, float* o, const float* w, float eps, const float* c, const float* s) {
    float normed[MAX_HEAD_DIM];
    const float* src = x;
    if (w != nullptr) {
      const float inv = 1.f / std::sqrt(sum_of_squares(x, D) / static_cast<float>(D) + eps);
      for (int64_t i = 0; i < D; ++i) normed[i] = w[i] * (x[i] * inv);
      src = normed;
    }
    for (int64_t i = 0; i < half; ++i) o[i] = src[i] * c[i] + (-src[i + half]) * s[i];
    for (int64_t i = half; i < D; ++i) o[i] = src[i] * c[i] + src[i - half] * s[i];
  };
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qop = qo.data_ptr<float>();
  float* kop = ko.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  // NOTE: one thread below ~32K elements (decode rows), as rms_norm
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>((H + Hk) * D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cp + r * cs;
      const float* s = sp + r * ss;
      for (int64_t h = 0; h < H; ++h) head(qp + r * qs + h * D, qop + (r * H + h) * D, wq, eq, c, s);
      for (int64_t h = 0; h < Hk; ++h) head(kp + r * ks + h * D, kop + (r * Hk + h) * D, wk, ek, c, s);
    }
  });
  return {qo, ko};
}
