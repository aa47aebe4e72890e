// The argmax of each row of a fp32 [R, V] CPU tensor: the greedy token of every row of a decode step.
//
// torch's `argmax(dim=-1)` on a CPU reads ~1.1 G floats a second here (16 rows x 32768: 0.46 ms, more than a
// layer's attention of the 100M model of `benchmarks/`); a vocabulary of 150K at 64 rows would be ~9 ms a step.
// This is one vectorised pass per row. Same result as torch, index for index: the first index of the largest
// value (-0.0 and 0.0 are equal), the first NaN if a row has one, 0 for a row of -inf.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "vec_exp.h"

namespace {

int64_t first_nan(const float* x, int64_t V) {
  for (int64_t i = 0; i < V; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t row_argmax(const float* x, int64_t V) {
  int64_t i = 1, best_i = 0;  // NOTE: x[0] is the first best; the vector pass, when it runs, moves i on
  float best = x[0];
  bool nan = std::isnan(x[0]);
#if defined(__AVX512F__)
  if (V >= 32) {
    // NOTE: per lane, the largest value so far and its first index (strictly greater replaces: ties keep the
    // earlier index); NaNs are only noted here, and looked up again at the end
    __m512 vbest = _mm512_loadu_ps(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nans = _mm512_cmp_ps_mask(vbest, vbest, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= V; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
      vbest = _mm512_mask_mov_ps(vbest, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
      nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nans) return first_nan(x, V);
    alignas(64) float bv[16];
    alignas(64) int32_t bi[16];
    _mm512_store_ps(bv, vbest);
    _mm512_store_si512(bi, vidx);
    best = bv[0], best_i = bi[0];
    for (int l = 1; l < 16; ++l) {
      if (bv[l] > best || (bv[l] == best && bi[l] < best_i)) best = bv[l], best_i = bi[l];
    }
  }
#endif
  for (; i < V; ++i) {  // NOTE: the tail (all of a short row): later indices, strictly greater
    const float v = x[i];
    if (std::isnan(v)) nan = true;
    if (v > best) best = v, best_i = i;
  }
  return nan ? first_nan(x, V) : best_i;
}

}  // namespace

// x: [R, V] fp32 CPU, V >= 1 -> [R] int64
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "argmax_rows: x is [R, V] fp32 CPU");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) < (int64_t{1} << 31), "argmax_rows: 1 <= V < 2^31");
  const auto xc = x.contiguous();
  const int64_t R = xc.size(0), V = xc.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // NOTE: rows split across threads only past ~64K floats a thread (waking the team costs more than less)
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * V, V);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Greedy verification of a speculative step in one call: each row's positions [its last token, its drafted
// tokens], in order, their argmax (`row_argmax`, index for index torch's) compared with the draft; a row stops at
// the first position whose argmax is not its drafted token (that argmax is the row's own next token) or after
// its last position. The emitted positions' log-softmax at their argmax, -log(sum(exp(x - max))), with the sum
// in fp32 lanes (`exp512`, vec_exp.h) reduced in fp64: the log-softmax a plain step's sampler reports, to float
// rounding. Positions after a row's stop are neither argmaxed nor summed.

namespace {

// log-softmax of x at its maximum `best`: -log(sum_i exp(x_i - best))
double logprob_at_max(const float* x, int64_t V, float best) {
  double sum = 0.0;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vbest = _mm512_set1_ps(best);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= V; i += 16) acc = _mm512_add_ps(acc, exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vbest)));
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < V; ++i) sum += std::exp(static_cast<double>(x[i]) - best);
  return -std::log(sum);
}

}  // namespace

// logits: [P, V] fp32 CPU, the rows' positions one after another; lens: [R], 1 + each row's draft length
// (sum = P); drafts: the drafts one after another (sum = P - R). Returns [2 P]: for each position its argmax and
// that argmax's log-softmax (with `logprobs`; else 0), or (-1, 0) where the row stopped before it.
std::vector<double> greedy_verify(const at::Tensor& logits, const std::vector<int64_t>& lens,
                                  const std::vector<int64_t>& drafts, bool logprobs) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "greedy_verify: logits is [P, V] fp32 CPU");
  const auto xc = logits.contiguous();
  const int64_t P = xc.size(0), V = xc.size(1), R = static_cast<int64_t>(lens.size());
  TORCH_CHECK(V >= 1 && V < (int64_t{1} << 31), "greedy_verify: 1 <= V < 2^31");
  std::vector<int64_t> first(R + 1, 0), dfirst(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lens[r] >= 1, "greedy_verify: every row runs at least its last token");
    first[r + 1] = first[r] + lens[r];
    dfirst[r + 1] = dfirst[r] + lens[r] - 1;
  }
  TORCH_CHECK(first[R] == P && dfirst[R] == static_cast<int64_t>(drafts.size()),
              "greedy_verify: lens sum to the logits' rows and the drafts' length");
  std::vector<double> out(2 * P, 0.0);
  for (int64_t p = 0; p < P; ++p) out[2 * p] = -1.0;
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < lens[r]; ++j) {
        const int64_t p = first[r] + j;
        const float* x = xp + p * V;
        const int64_t t = row_argmax(x, V);
        out[2 * p] = static_cast<double>(t);
        if (logprobs) out[2 * p + 1] = logprob_at_max(x, V, x[t]);
        if (j == lens[r] - 1 || drafts[dfirst[r] + j] != t) break;  // NOTE: a rejected draft, or the last position
      }
    }
  });
  return out;
}
