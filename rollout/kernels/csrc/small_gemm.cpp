// Small-M fp32 linear for decode steps on a CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= ~48 rows.
//
// A decode step multiplies a few rows by every weight of the model, so it reads the weights from memory
// once per step and does little arithmetic per byte. oneDNN's packed linears read and compute in turn:
// on the 100M model of `benchmarks/`, 16 rows took 14-15 ms at 2 threads against 11 ms for 1 row, the
// memory time and the FMA time adding up. This kernel keeps both busy at once: each thread streams its own
// contiguous run of weight panels and prefetches PREFETCH_FLOATS ahead of the panel it is computing, so the
// next panel is arriving while the FMAs of the current one run (benchmarks/decode_linears.py).
//
// Layout: `pack_panels` lays W out as [ceil(N / 16)][K][16] (16 output columns per panel, K-major, the last
// panel zero-padded), so a panel is one contiguous stream and each k step loads one 16-wide vector of it.
// The rows of x are transposed once per call to [K][M] so that the 16 broadcasts of a k step read one cache
// line. A tile is 16 rows x 16 columns: 16 accumulators, one weight load and 16 broadcast FMAs per k.
//
// Above MB rows (a verifying step's 4 x (1 + 8) tokens, a 17-48-row decode batch) a tile is up to MB2 rows x 2
// panels instead: 2 weight loads and R broadcasts feed 2R FMAs a k step (1 + R loads for R FMAs in one panel),
// the rows split evenly over the fewest tiles (36 rows: 3 x 12, not 16 + 16 + 4), each pair of panels a unit of
// the threads' work. Up to MB rows every panel is still read once, by one tile (where the weights stream from
// memory, a second pass over them is what costs).
//
// Each output element is one fp32 dot product accumulated in k order, independent of M and of how the
// rows are tiled (the same bits for a row whatever the batch around it). It differs from F.linear by float
// rounding only (another summation order).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t NB = 16;                // output columns per panel (one AVX-512 vector)
constexpr int MB = 16;                    // rows per tile
constexpr int MB2 = 14;                   // most rows per two-panel tile (28 accumulators, 2 weights, 1 broadcast)
constexpr int64_t PREFETCH_FLOATS = 4096; // 16 KB ahead of the weights being read (measured: 8-16 KB best)
// NOTE: the prefetch fills L2, not L1 (_MM_HINT_T1): on the 2-core EPYC of benchmarks/, 16 rows of the 100M
// model's linears took 16.4-17.9 ms against 21.8-22.0 ms with _MM_HINT_T0 (decode_linears.py, interleaved);
// 4-64 KB ahead into L2 or L3 all measured 16.7-17.7 ms in a scratch sweep; into L1 or non-temporal
// 18.3-20.0 ms; no software prefetch 22.5 ms

#if defined(__AVX512F__)
// the columns of panel n (n0 + n x 16 ..) that exist: all 16, or the first N - that of a partial last panel
inline __mmask16 columns(int64_t N, int64_t n) {
  return N - n >= NB ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
}

// R rows x NP adjacent panels (columns n0 .. n0 + 16 NP, the last maybe partial): R x NP accumulators, NP weight
// loads and R broadcasts a k step. Each element is one dot product accumulated in k order from its bias, whatever
// R and NP, so a row's outputs are the same bits however the rows and panels are tiled.
template <int R, int NP>
inline void tile(const float* __restrict xt, int64_t M, const float* __restrict wp, int64_t K,
                 const float* __restrict bias, float* __restrict y, int64_t N, int64_t n0, bool prefetch) {
  __m512 acc[NP][R];
  __mmask16 keep[NP];
#pragma GCC unroll 2
  for (int j = 0; j < NP; ++j) {
    keep[j] = columns(N, n0 + j * NB);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep[j], bias + n0 + j * NB) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[j][r] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {  // NOTE: panel j is K x 16 floats after panel j - 1 ([P][K][16])
      const float* wj = wp + j * K * NB + k * NB;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wj + PREFETCH_FLOATS), _MM_HINT_T1);
      w[j] = _mm512_loadu_ps(wj);
    }
    const float* xk = xt + k * M;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xk[r]);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[j][r] = _mm512_fmadd_ps(xv, w[j], acc[j][r]);
    }
  }
#pragma GCC unroll 2
  for (int j = 0; j < NP; ++j)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + n0 + j * NB, keep[j], acc[j][r]);
}

// the M rows of xt ([K, M]) against one panel; tiles of MB rows, then the remainder
void panel(const float* xt, int64_t M, const float* wp, int64_t K, const float* bias, float* y, int64_t N,
           int64_t n0) {
  int64_t m = 0;
  bool prefetch = true;  // NOTE: the first tile streams the panel from memory; later tiles find it in L1/L2
  for (; m + MB <= M; m += MB, prefetch = false) tile<MB, 1>(xt + m, M, wp, K, bias, y + m * N, N, n0, prefetch);
  switch (M - m) {
    case 0: break;
#define ROLLOUT_TAIL(R) \
    case R: tile<R, 1>(xt + m, M, wp, K, bias, y + m * N, N, n0, prefetch); break;
    ROLLOUT_TAIL(1) ROLLOUT_TAIL(2) ROLLOUT_TAIL(3) ROLLOUT_TAIL(4) ROLLOUT_TAIL(5) ROLLOUT_TAIL(6)
    ROLLOUT_TAIL(7) ROLLOUT_TAIL(8) ROLLOUT_TAIL(9) ROLLOUT_TAIL(10) ROLLOUT_TAIL(11) ROLLOUT_TAIL(12)
    ROLLOUT_TAIL(13) ROLLOUT_TAIL(14) ROLLOUT_TAIL(15)
#undef ROLLOUT_TAIL
    default: break;
  }
}

// the M rows of xt against two adjacent panels, in the fewest tiles of at most MB2 rows, rows split evenly
void pair(const float* xt, int64_t M, const float* wp, int64_t K, const float* bias, float* y, int64_t N,
          int64_t n0) {
  const int64_t tiles = (M + MB2 - 1) / MB2, base = M / tiles, extra = M % tiles;
  bool prefetch = true;  // NOTE: the first tile streams the panels from memory; later tiles find them in L2
  for (int64_t t = 0, m = 0; t < tiles; ++t, prefetch = false) {
    const int64_t R = base + (t < extra ? 1 : 0);
    switch (R) {
#define ROLLOUT_PAIR(R) \
      case R: tile<R, 2>(xt + m, M, wp, K, bias, y + m * N, N, n0, prefetch); break;
      ROLLOUT_PAIR(1) ROLLOUT_PAIR(2) ROLLOUT_PAIR(3) ROLLOUT_PAIR(4) ROLLOUT_PAIR(5) ROLLOUT_PAIR(6) ROLLOUT_PAIR(7)
      ROLLOUT_PAIR(8) ROLLOUT_PAIR(9) ROLLOUT_PAIR(10) ROLLOUT_PAIR(11) ROLLOUT_PAIR(12) ROLLOUT_PAIR(13)
      ROLLOUT_PAIR(14)
#undef ROLLOUT_PAIR
      default: break;
    }
    m += R;
  }
}

// a unit of the threads' work: panel p alone, or panels p and p + 1 (above MB rows, where a panel has a next one)
inline void unit(const float* xt, int64_t M, const float* wp, int64_t K, const float* bias, float* y, int64_t N,
                 int64_t P, int64_t u, bool pairs) {
  const int64_t p = pairs ? 2 * u : u;
  if (pairs && p + 1 < P) pair(xt, M, wp + p * K * NB, K, bias, y, N, p * NB);
  else panel(xt, M, wp + p * K * NB, K, bias, y, N, p * NB);
}

// r[i] (row i of a 16 x 16 block) <- column i: unpacks of lanes, then of pairs, then 128-bit shuffles twice
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

// x [M, K] as [K, M], so that a k step's broadcasts read one cache line (measured: 1.1-1.2x over reading the rows
// in place), in 16 x 16 blocks transposed in registers (masked at the edges). A scalar loop cost more than the
// FMAs it feeds at verifying sizes: 36 x 2048 (a 100M down projection's input) took ~100 us, 57 us k-major.
std::vector<float> transposed(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto xc = x.contiguous();
  const float* a = xc.data_ptr<float>();
  if (M == 1) return std::vector<float>(a, a + K);
  std::vector<float> xt(static_cast<size_t>(M * K));
  float* t = xt.data();
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t mr = std::min<int64_t>(16, M - m0);
    const auto rows = static_cast<__mmask16>((1u << mr) - 1);
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const int64_t kr = std::min<int64_t>(16, K - k0);
      const auto cols = static_cast<__mmask16>((1u << kr) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < mr ? _mm512_maskz_loadu_ps(cols, a + (m0 + i) * K + k0) : _mm512_setzero_ps();
      transpose16(r);
      for (int j = 0; j < kr; ++j) _mm512_mask_storeu_ps(t + (k0 + j) * M + m0, rows, r[j]);
    }
  }
  return xt;
}
#endif

}  // namespace

bool small_gemm_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// W [N, K] fp32 -> panels [ceil(N / 16), K, 16] (the last panel's missing columns are zeros)
at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack_panels: a 2-D fp32 CPU weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NB - 1) / NB;
  auto padded = at::zeros({P * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, NB, K}).transpose(1, 2).contiguous();
}

// y [M, N] = x [M, K] @ W^T + bias, W given as `pack_panels(W)` with N its row count
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                        int64_t N) {
  TORCH_CHECK(small_gemm_available(), "small_linear: this build has no AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "small_linear: x is [M, K] fp32");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == NB && panels.size(1) == x.size(1) && (N + NB - 1) / NB == panels.size(0),
              "small_linear: panels must be pack_panels(W) of a [N, K] weight with K = x.size(1)");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "small_linear: bias is [N] fp32");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#if defined(__AVX512F__)
  const std::vector<float> xt = transposed(x);
  const float* xp = xt.data();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // NOTE: contiguous runs of panels per thread: each thread's weights are one sequential stream
  const bool pairs = M > MB;
  at::parallel_for(0, pairs ? (P + 1) / 2 : P, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) unit(xp, M, wp, K, bp, yp, N, P, u, pairs);
  });
#endif
  return y;
}

// Several linears of the same input in one call (an attention's q / k / v projections, a gated MLP's gate and
// up): y_i = x @ W_i^T + bias_i, each W_i as `pack_panels(W_i)` with N_i rows. One transpose of x and one
// parallel region over all the panels, in order: each thread streams a contiguous run of them, across weights.
// Each y_i is bitwise `small_linear(x, panels_i, bias_i, N_i)`.
std::vector<at::Tensor> small_linears(const at::Tensor& x, const std::vector<at::Tensor>& panels,
                                      const std::vector<c10::optional<at::Tensor>>& biases,
                                      const std::vector<int64_t>& Ns) {
  TORCH_CHECK(small_gemm_available(), "small_linears: this build has no AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "small_linears: x is [M, K] fp32");
  const size_t W = panels.size();
  TORCH_CHECK(W > 0 && biases.size() == W && Ns.size() == W, "small_linears: one bias and one N per weight");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<const float*> wps(W), bps(W, nullptr);
  std::vector<float*> yps(W);
  const bool pairs = M > MB;
  std::vector<int64_t> first(W + 1, 0);  // NOTE: weight i's units are [first[i], first[i + 1]) of the whole run
  std::vector<at::Tensor> ys;
  ys.reserve(W);
  for (size_t i = 0; i < W; ++i) {
    const auto& p = panels[i];
    const int64_t N = Ns[i];
    TORCH_CHECK(p.dim() == 3 && p.scalar_type() == at::kFloat && p.is_contiguous() && p.size(2) == NB &&
                    p.size(1) == K && (N + NB - 1) / NB == p.size(0),
                "small_linears: panels[", i, "] must be pack_panels(W) of a [N, K] weight with K = x.size(1)");
    if (biases[i].has_value() && biases[i]->defined()) {
      const auto& b = *biases[i];
      TORCH_CHECK(b.dim() == 1 && b.numel() == N && b.scalar_type() == at::kFloat && b.is_contiguous(),
                  "small_linears: biases[", i, "] is [N] fp32");
      bps[i] = b.data_ptr<float>();
    }
    ys.push_back(at::empty({M, N}, x.options()));
    wps[i] = p.data_ptr<float>();
    yps[i] = ys.back().data_ptr<float>();
    first[i + 1] = first[i] + (pairs ? (p.size(0) + 1) / 2 : p.size(0));
  }
  if (M == 0) return ys;
#if defined(__AVX512F__)
  const std::vector<float> xt = transposed(x);
  const float* xp = xt.data();
  at::parallel_for(0, first[W], 1, [&](int64_t u0, int64_t u1) {
    size_t i = std::upper_bound(first.begin(), first.end(), u0) - first.begin() - 1;
    for (int64_t u = u0; u < u1; ++u) {
      while (u >= first[i + 1]) ++i;
      unit(xp, M, wps[i], K, bps[i], yps[i], Ns[i], panels[i].size(0), u - first[i], pairs);
    }
  });
#endif
  return ys;
}
