// silu(gate) * up in one pass for fp32 CPU tensors (the gated MLP of Llama-family models).
//
// transformers runs `act_fn(gate_proj(x)) * up_proj(x)` as two ops, each a pass over [tokens, intermediate]
// floats; in a prompt chunk of 512 tokens of the 100M model that was ~1 ms of silu and ~0.5 ms of mul per
// layer. This is one pass with a vectorised exp (Cephes-style range reduction and polynomial, ~1 ulp), so the
// result equals torch's up to float rounding.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace {

#if defined(__AVX512F__)
// exp(x) for any float x (overflow to inf above ~88.7, underflow to 0 below ~-103)
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace

// gate, up: same shape, fp32 CPU -> silu(gate) * up
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.device().is_cpu() &&
                  up.device().is_cpu(),
              "silu_mul: fp32 CPU tensors");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up must have the same shape");
  const auto g = gate.contiguous(), u = up.contiguous();
  auto y = at::empty_like(g);
  const int64_t n = g.numel();
  const float* gp = g.data_ptr<float>();
  const float* upp = u.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // NOTE: one thread below 64K elements (decode rows): waking the team costs more than the work
  at::parallel_for(0, n, 65536, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= i1; i += 16) {
      const __m512 a = _mm512_loadu_ps(gp + i);
      const __m512 s = _mm512_div_ps(a, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), a))));
      _mm512_storeu_ps(yp + i, _mm512_mul_ps(s, _mm512_loadu_ps(upp + i)));
    }
#endif
    for (; i < i1; ++i) yp[i] = gp[i] / (1.f + std::exp(-gp[i])) * upp[i];
  });
  return y;
}
