// Decode attention over contiguous per-request KV rows ("lanes"), for CPUs.
//
// One query token per request. For each (request, KV head) the keys and the values are streamed
// once from memory for all the query heads that share that KV head (GQA), so the cost is one read
// of the request's K and V: the bound this op cannot beat. torch's CPU SDPA reads them once per
// query head and runs per-head GEMM calls with one row, at a third to a half of that bandwidth.
// Head sizes 64 and 128 with 1, 2 or 4 query heads per KV head have register-resident specialisations;
// anything else takes a generic loop.
//
// Layouts (fp32, contiguous):
//   q    [n, H, D]             one query per request
//   k, v [NL, Hkv, Lcap, D]    lanes; request i reads lane lane[i], positions 0 .. len[i] - 1
//   out  [n, H, D]
// softcap > 0 applies Gemma 2's cap * tanh(score / cap) to the scaled scores.
// The result equals softmax(q K^T * scale) V up to float rounding (not bitwise equal to torch's SDPA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp(x) for x <= 0 (scores minus their max), Cephes-style, about 1 ulp; written so gcc vectorises it.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace

// Softmax of the G score rows s[g * L .. g * L + L) in place (probabilities, unnormalised), with
// Gemma 2's softcap first when cap > 0; r[g] = 1 / sum of row g.
inline void softmax_rows(float* s, int64_t G, int64_t L, float cap, float* r) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    if (cap > 0.f) {
      for (int64_t j = 0; j < L; ++j) sg[j] = cap * std::tanh(sg[j] / cap);
    }
    float m = sg[0];
    for (int64_t j = 1; j < L; ++j) m = std::max(m, sg[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < L; ++j) {
      const float e = exp_nonpos(sg[j] - m);
      sg[j] = e;
      sum += e;
    }
    r[g] = 1.f / sum;
  }
}

// One (request, KV head) with GG query heads of size DIM known at compile time: one pass over the keys
// scores all GG heads (two keys at a time, so 2 x GG independent FMA chains), one pass over the values
// accumulates all GG outputs in registers.
template <int DIM, int GG>
void attend_fixed(const float* Q, const float* K, const float* V, float* O, int64_t L, float sc, float cap,
                  float* s) {
  constexpr int64_t D = DIM;
  int64_t j = 0;
  for (; j + 2 <= L; j += 2) {
    const float* k0 = K + j * D;
    const float* k1 = k0 + D;
    for (int g = 0; g < GG; ++g) {
      const float* qg = Q + g * D;
      float d0 = 0.f, d1 = 0.f;
#pragma omp simd reduction(+ : d0, d1)
      for (int64_t d = 0; d < D; ++d) {
        d0 += qg[d] * k0[d];
        d1 += qg[d] * k1[d];
      }
      s[g * L + j] = d0 * sc;
      s[g * L + j + 1] = d1 * sc;
    }
  }
  for (; j < L; ++j) {
    const float* kj = K + j * D;
    for (int g = 0; g < GG; ++g) {
      const float* qg = Q + g * D;
      float d0 = 0.f;
#pragma omp simd reduction(+ : d0)
      for (int64_t d = 0; d < D; ++d) d0 += qg[d] * kj[d];
      s[g * L + j] = d0 * sc;
    }
  }
  float r[GG];
  softmax_rows(s, GG, L, cap, r);
  float acc[GG][D];
  for (int g = 0; g < GG; ++g)
    for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
  for (int64_t jj = 0; jj < L; ++jj) {
    const float* vj = V + jj * D;
    for (int g = 0; g < GG; ++g) {
      const float pj = s[g * L + jj];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[g][d] += pj * vj[d];
    }
  }
  for (int g = 0; g < GG; ++g)
    for (int64_t d = 0; d < D; ++d) O[g * D + d] = acc[g][d] * r[g];
}

// Any head size and group: one query head at a time (K and V re-read from cache for the next head).
void attend_any(const float* Q, const float* K, const float* V, float* O, int64_t G, int64_t L, int64_t D,
                float sc, float cap, float* s, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = Q + g * D;
    float* sg = s + g * L;
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) {  // NOTE: four independent accumulator chains hide the FMA latency
      const float* k0 = K + j * D;
      const float* k1 = k0 + D;
      const float* k2 = k1 + D;
      const float* k3 = k2 + D;
      float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
      for (int64_t d = 0; d < D; ++d) {
        const float x = qg[d];
        d0 += x * k0[d];
        d1 += x * k1[d];
        d2 += x * k2[d];
        d3 += x * k3[d];
      }
      sg[j] = d0 * sc;
      sg[j + 1] = d1 * sc;
      sg[j + 2] = d2 * sc;
      sg[j + 3] = d3 * sc;
    }
    for (; j < L; ++j) {
      const float* kj = K + j * D;
      float d0 = 0.f;
#pragma omp simd reduction(+ : d0)
      for (int64_t d = 0; d < D; ++d) d0 += qg[d] * kj[d];
      sg[j] = d0 * sc;
    }
  }
  std::vector<float> r(G);
  softmax_rows(s, G, L, cap, r.data());
  for (int64_t g = 0; g < G; ++g) {
    const float* sg = s + g * L;
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      const float pj = sg[j];
      const float* vj = V + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += pj * vj[d];
    }
    for (int64_t d = 0; d < D; ++d) O[g * D + d] = acc[d] * r[g];
  }
}

void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lane,
                      const at::Tensor& len, double scale, double softcap, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "decode_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "decode_attention: fp32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && out.is_contiguous(),
              "decode_attention: contiguous tensors only");
  TORCH_CHECK(lane.scalar_type() == at::kLong && len.scalar_type() == at::kLong, "decode_attention: int64 indices");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NL = k.size(0), Hkv = k.size(1), Lcap = k.size(2);
  TORCH_CHECK(k.size(3) == D && H % Hkv == 0 && out.sizes() == q.sizes(), "decode_attention: shapes disagree");
  TORCH_CHECK(D <= 1024, "decode_attention: head size above 1024");
  TORCH_CHECK(lane.numel() == n && len.numel() == n, "decode_attention: one lane and one length per query");
  const int64_t G = H / Hkv;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* lanep = lane.data_ptr<int64_t>();
  const int64_t* lenp = len.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lanep[i] >= 0 && lanep[i] < NL && lenp[i] >= 1 && lenp[i] <= Lcap,
                "decode_attention: lane or length out of range");
  }
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;  // [G, L] scores, then probabilities
    std::vector<float> acc(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / Hkv, h = item % Hkv;
      const int64_t L = lenp[i];
      const int64_t base = (lanep[i] * Hkv + h) * Lcap * D;
      const int64_t qo = (i * H + h * G) * D;
      if (static_cast<int64_t>(s.size()) < G * L) s.resize(G * L);
      const float* Qi = qp + qo;
      const float* Ki = kp + base;
      const float* Vi = vp + base;
      float* Oi = op + qo;
      if (D == 64 && G == 1) {
        attend_fixed<64, 1>(Qi, Ki, Vi, Oi, L, sc, cap, s.data());
      } else if (D == 64 && G == 2) {
        attend_fixed<64, 2>(Qi, Ki, Vi, Oi, L, sc, cap, s.data());
      } else if (D == 64 && G == 4) {
        attend_fixed<64, 4>(Qi, Ki, Vi, Oi, L, sc, cap, s.data());
      } else if (D == 128 && G == 1) {
        attend_fixed<128, 1>(Qi, Ki, Vi, Oi, L, sc, cap, s.data());
      } else if (D == 128 && G == 2) {
        attend_fixed<128, 2>(Qi, Ki, Vi, Oi, L, sc, cap, s.data());
      } else if (D == 128 && G == 4) {
        attend_fixed<128, 4>(Qi, Ki, Vi, Oi, L, sc, cap, s.data());
      } else {
        attend_any(Qi, Ki, Vi, Oi, G, L, D, sc, cap, s.data(), acc.data());
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over lanes (fp32, CPU)");
}
