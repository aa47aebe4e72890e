// Decode attention over the paged KV cache, for CPUs.
//
// One query token per request. For each (request, KV head) the keys and the values are streamed
// once from memory for all the query heads that share that KV head (GQA), so the cost is one read
// of the request's K and V: the bound this op cannot beat. torch's CPU SDPA reads them once per
// query head and runs per-head GEMM calls with one row, at a third to a half of that bandwidth.
// Head sizes 64 and 128 with 1-4, 6, 7 or 8 query heads per KV head, and 256 with 1 or 2, have
// specialisations that keep each head's accumulators together; anything else takes a generic loop.
// On AVX-512, for up to 8 query heads per KV head at head size 64 and 4 at 128 (at most 32 output vectors) and
// no softcap, keys and values are read in one pass (online softmax, `attend_online_avx512`):
// each block of 16 keys is scored and its values accumulated at once, fetched into L2 a block ahead. The
// two-pass form (all scores, then the values) ran at ~40% of this machine's read bandwidth on cold pages:
// its compute (~45 GB/s when the pages are in cache) and its memory traffic did not overlap.
//
// Layouts (contiguous):
//   q     [n, H, D] fp32        one query per request
//   k, v  [Hkv, slots, D]       the paged cache, head-major, slot = block * page_size + offset;
//                               fp32, bf16 or fp16 (half precision widened to fp32 as it is read)
//   table [n, P] int64          block table of each request; it reads positions start[i] .. end[i] - 1
//   out   [n, H, D] fp32
// softcap > 0 applies Gemma 2's cap * tanh(score / cap) to the scaled scores.
// The result equals softmax(q K^T * scale) V up to float rounding (not bitwise equal to torch's SDPA).
// `cascade_decode_attention` (same arguments) finds rows whose tables share full pages (same block ids), and the
// slots of a partial page that all of them read from one block (a verifying row's tokens; forks' copied prompt
// page), and reads those keys once for all their query heads, merging by log-sum-exp (equal up to float rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>
#include <utility>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// K/V elements: fp32 as they are, bf16 (stored as uint16) and fp16 (_Float16) widened to fp32 (both exact).
inline float load(float x) { return x; }
inline float load(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(_Float16 x) { return static_cast<float>(x); }

}  // namespace

// Softmax of the G score rows s[g * L .. g * L + L) in place (probabilities, unnormalised), with
// Gemma 2's softcap first when cap > 0; r[g] = 1 / sum of row g; lse[g] (when lse is not null) = the log-sum-exp
// of row g's (capped) scores, for merging partial softmaxes over disjoint key sets.
inline void softmax_rows(float* s, int64_t G, int64_t L, float cap, float* r, float* lse) {
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
    if (lse != nullptr) lse[g] = m + std::log(sum);
  }
}

// The keys (and values) of one (request, KV head) as runs of contiguous rows: one run per page.
template <typename T>
struct Runs {
  const T* const* k;  // [n] first key row of each run
  const T* const* v;  // [n] first value row of each run
  const int64_t* len;     // [n] rows in each run
  int64_t n;
};

// One (request, KV head) with GG query heads of size DIM known at compile time: one pass over the keys
// scores all GG heads (two keys at a time, so 2 x GG independent FMA chains), one pass over the values
// accumulates all GG outputs in registers.
template <int DIM, int GG, typename T>
void attend_fixed(const float* Q, const Runs<T>& runs, float* O, int64_t L, float sc, float cap, float* s, float* lse) {
  constexpr int64_t D = DIM;
  int64_t off = 0;
  for (int64_t r = 0; r < runs.n; ++r) {
    const T* K = runs.k[r];
    const int64_t cnt = runs.len[r];
    float* so = s + off;
    int64_t j = 0;
    for (; j + 2 <= cnt; j += 2) {
      const T* k0 = K + j * D;
      const T* k1 = k0 + D;
      for (int g = 0; g < GG; ++g) {
        const float* qg = Q + g * D;
        float d0 = 0.f, d1 = 0.f;
#pragma omp simd reduction(+ : d0, d1)
        for (int64_t d = 0; d < D; ++d) {
          d0 += qg[d] * load(k0[d]);
          d1 += qg[d] * load(k1[d]);
        }
        so[g * L + j] = d0 * sc;
        so[g * L + j + 1] = d1 * sc;
      }
    }
    for (; j < cnt; ++j) {
      const T* kj = K + j * D;
      for (int g = 0; g < GG; ++g) {
        const float* qg = Q + g * D;
        float d0 = 0.f;
#pragma omp simd reduction(+ : d0)
        for (int64_t d = 0; d < D; ++d) d0 += qg[d] * load(kj[d]);
        so[g * L + j] = d0 * sc;
      }
    }
    off += cnt;
  }
  float r[GG];
  softmax_rows(s, GG, L, cap, r, lse);
  float acc[GG][D];
  for (int g = 0; g < GG; ++g)
    for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
  off = 0;
  for (int64_t run = 0; run < runs.n; ++run) {
    const T* V = runs.v[run];
    const int64_t cnt = runs.len[run];
    for (int64_t jj = 0; jj < cnt; ++jj) {
      const T* vj = V + jj * D;
      for (int g = 0; g < GG; ++g) {
        const float pj = s[g * L + off + jj];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[g][d] += pj * load(vj[d]);
      }
    }
    off += cnt;
  }
  for (int g = 0; g < GG; ++g)
    for (int64_t d = 0; d < D; ++d) O[g * D + d] = acc[g][d] * r[g];
}

#if defined(__AVX512F__)
// How far ahead of the key being scored its row is prefetched (keys; 8 KB of fp32 keys at head dim 64). Measured
// on 12 cold layers of 16 rows x 1032 keys, 2 threads: 32 and 64 keys 7-10% faster than none, 128 less.
constexpr int64_t PREFETCH_KEYS = 32;

// Prefetch every 64-byte line of [p, p + nbytes) with hint HINT (_MM_HINT_T0: into L1, _MM_HINT_T1: into L2).
template <int HINT>
inline void prefetch_lines(const void* p, int64_t nbytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < nbytes; b += 64) _mm_prefetch(c + b, static_cast<_mm_hint>(HINT));
}

// AVX-512 version of `attend_fixed` (the build uses -march=native, so this is what AVX-512 machines run).
// Scores: 16 keys at a time, each key's D-long dot product left as a 16-lane partial sum, and the 16
// partial sums reduced together by one transpose-and-add tree (45 shuffles and adds for 16 keys instead
// of a horizontal reduction per key). Values: the output rows of up to 16 / (D / 16) heads at a time
// stay in registers while the value rows stream past.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const _Float16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Lane i of the result = the sum of the 16 lanes of v[i].
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], w[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // w[i]: in each 128-bit lane l, the lane-l partial sums of v[4i .. 4i + 3]
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// O[g] = rcp[g] * sum over keys of P(g, key) * V[key] for NG query heads, with P(g, key) = P[g * head_stride +
// key * key_stride] (the head-major scores of `attend_fixed_avx512`, the key-major ones of `attend_many_avx512`):
// the value rows stream past the outputs of 16 / (DIM / 16) heads held in registers.
template <int DIM, typename T>
inline void weighted_values(const Runs<T>& runs, const float* P, int64_t head_stride, int64_t key_stride, int64_t NG,
                            const float* rcp, float* O) {
  constexpr int V = DIM / 16;                      // vectors per row
  constexpr int HB = (16 / V) > 0 ? (16 / V) : 1;  // heads whose outputs stay in registers together
  for (int64_t g0 = 0; g0 < NG; g0 += HB) {
    const int gn = static_cast<int>(std::min<int64_t>(HB, NG - g0));
    __m512 acc[HB][V];
    for (int g = 0; g < HB; ++g)
      for (int c = 0; c < V; ++c) acc[g][c] = _mm512_setzero_ps();
    int64_t off = 0;
    for (int64_t run = 0; run < runs.n; ++run) {
      const T* Vr = runs.v[run];
      const int64_t cnt = runs.len[run];
      for (int64_t jj = 0; jj < cnt; ++jj) {
        const T* vj = Vr + jj * DIM;
        const float* pj = P + (off + jj) * key_stride + g0 * head_stride;
        __m512 vv[V];
        for (int c = 0; c < V; ++c) vv[c] = load16(vj + 16 * c);
        for (int g = 0; g < HB; ++g) {
          if (g >= gn) break;
          const __m512 p = _mm512_set1_ps(pj[g * head_stride]);
          for (int c = 0; c < V; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
      }
      off += cnt;
    }
    for (int g = 0; g < gn; ++g) {
      const __m512 rr = _mm512_set1_ps(rcp[g0 + g]);
      for (int c = 0; c < V; ++c) _mm512_storeu_ps(O + (g0 + g) * DIM + 16 * c, _mm512_mul_ps(acc[g][c], rr));
    }
  }
}

// GG == 0: the number of query heads is the runtime `gg` (the shared pages of a cascade group: every query
// head of the group's rows against the same keys, a small GEMM whose key tile stays in L1 across heads).
template <int DIM, int GG, typename T>
void attend_fixed_avx512(const float* Q, const Runs<T>& runs, float* O, int64_t L, float sc, float cap, float* s,
                         float* lse, float* rcp, int gg) {
  constexpr int V = DIM / 16;  // vectors per row
  const int NG = GG > 0 ? GG : gg;
  const __m512 scale = _mm512_set1_ps(sc);
  int64_t off = 0;
  for (int64_t r = 0; r < runs.n; ++r) {
    const T* K = runs.k[r];
    const T* Vp = runs.v[r];
    const int64_t cnt = runs.len[r];
    if (r + 1 < runs.n) {  // NOTE: pages are scattered: fetch the next page's first keys while this one is scored
      prefetch_lines<_MM_HINT_T0>(runs.k[r + 1], std::min<int64_t>(runs.len[r + 1], 16) * DIM * sizeof(T));
    }
    int64_t j = 0;
    for (; j + 16 <= cnt; j += 16) {
      const T* kb = K + j * DIM;
      // NOTE: the values of these keys are read right after the scores: start fetching them into L2 now
      prefetch_lines<_MM_HINT_T1>(Vp + j * DIM, 16 * DIM * sizeof(T));
      // NOTE: and the keys PREFETCH_KEYS ahead: the hardware's stream prefetcher stops at every 4 KB page, and
      // a page of the cache spans several of them (see PREFETCH_KEYS)
      if (j + 16 + PREFETCH_KEYS <= cnt) prefetch_lines<_MM_HINT_T0>(kb + PREFETCH_KEYS * DIM, 16 * DIM * sizeof(T));
      for (int g = 0; g < NG; ++g) {
        __m512 q[V];
        for (int c = 0; c < V; ++c) q[c] = _mm512_loadu_ps(Q + g * DIM + 16 * c);
        __m512 part[16];
        for (int jj = 0; jj < 16; ++jj) {
          const T* kj = kb + jj * DIM;
          __m512 a = _mm512_mul_ps(q[0], load16(kj));
          for (int c = 1; c < V; ++c) a = _mm512_fmadd_ps(q[c], load16(kj + 16 * c), a);
          part[jj] = a;
        }
        _mm512_storeu_ps(s + g * L + off + j, _mm512_mul_ps(reduce16(part), scale));
      }
    }
    for (; j < cnt; ++j) {
      const T* kj = K + j * DIM;
      for (int g = 0; g < NG; ++g) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(Q + g * DIM), load16(kj));
        for (int c = 1; c < V; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(Q + g * DIM + 16 * c), load16(kj + 16 * c), a);
        s[g * L + off + j] = _mm512_reduce_add_ps(a) * sc;
      }
    }
    off += cnt;
  }
  softmax_rows(s, NG, L, cap, rcp, lse);
  weighted_values<DIM, T>(runs, s, L, 1, NG, rcp, O);
}

// exp(x) of 16 lanes for x <= 0: `exp_nonpos` lane by lane (the same constants and steps).
inline __m512 exp16_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Scores of KB consecutive keys against NV x 16 query heads: an outer product over the head dim (no horizontal
// sums). qt: [DIM, MP] queries (scaled), key-major out: st[kk * MP + head].
template <int DIM, int KB, int NV, typename T>
inline void scores_block(const float* __restrict qt, int64_t MP, const T* __restrict K, float* __restrict st) {
  __m512 acc[KB][NV];
  for (int kk = 0; kk < KB; ++kk)
    for (int u = 0; u < NV; ++u) acc[kk][u] = _mm512_setzero_ps();
  for (int d = 0; d < DIM; ++d) {
    __m512 q[NV];
    for (int u = 0; u < NV; ++u) q[u] = _mm512_loadu_ps(qt + d * MP + 16 * u);
    for (int kk = 0; kk < KB; ++kk) {
      const __m512 b = _mm512_set1_ps(load(K[kk * DIM + d]));
      for (int u = 0; u < NV; ++u) acc[kk][u] = _mm512_fmadd_ps(q[u], b, acc[kk][u]);
    }
  }
  for (int kk = 0; kk < KB; ++kk)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(st + kk * MP + 16 * u, acc[kk][u]);
}

template <int DIM, int KB, typename T>
inline void scores_keys(const float* qt, int64_t MV, int64_t MP, const T* K, float* st) {
  for (int64_t v0 = 0; v0 < MV; v0 += 4) {
    switch (std::min<int64_t>(4, MV - v0)) {
      case 4: scores_block<DIM, KB, 4, T>(qt + 16 * v0, MP, K, st + 16 * v0); break;
      case 3: scores_block<DIM, KB, 3, T>(qt + 16 * v0, MP, K, st + 16 * v0); break;
      case 2: scores_block<DIM, KB, 2, T>(qt + 16 * v0, MP, K, st + 16 * v0); break;
      default: scores_block<DIM, KB, 1, T>(qt + 16 * v0, MP, K, st + 16 * v0); break;
    }
  }
}

// How far ahead of the block being scored `attend_online_avx512` fetches keys and values into L2 (keys; 4 KB of
// fp32 keys at head dim 64). Measured (5M and 100M Qwen3 layer shapes, 32-64 rows x ~1000 keys, 2 threads, cold
// pages, interleaved in one process): into L2 16 keys ahead 1.2-1.5x the two-pass kernel; into L1 (T0) or 32-256
// keys ahead no better than no software prefetch.
constexpr int64_t ONLINE_PREFETCH_KEYS = 16;

// Whether `attend_online_avx512` takes GG query heads of size DIM: at most 32 output vectors, head size <= 128 (at
// 256 a key's 16 vectors alone would crowd the accumulators out).
template <int DIM, int GG>
constexpr bool one_pass_fits() { return GG * DIM / 16 <= 32 && DIM <= 128; }

// One pass over the keys and values of one (request, KV head) for GG query heads (`one_pass_fits`; above 16 output
// vectors some accumulators live in L1: still 1.4x the two-pass kernel at 8 heads x 64): each block of 16 keys is
// scored, folded into a running max and sum (online softmax) and its values accumulated right away, so K and V
// stream from memory together and nothing is stored and read back. Equal to `attend_fixed_avx512` up to float
// rounding (a different order of the same sums).
template <int DIM, int GG, typename T>
void attend_online_avx512(const float* Q, const Runs<T>& runs, float* O, float sc, float* lse) {
  constexpr int V = DIM / 16;  // vectors per row
  static_assert(one_pass_fits<DIM, GG>(), "at most 32 output vectors, head size <= 128");
  const __m512 scale = _mm512_set1_ps(sc);
  __m512 acc[GG][V], lsum[GG];
  float mx[GG];
  for (int g = 0; g < GG; ++g) {
    for (int c = 0; c < V; ++c) acc[g][c] = _mm512_setzero_ps();
    lsum[g] = _mm512_setzero_ps();
    mx[g] = -INFINITY;
  }
  alignas(64) float pb[GG][16];
  for (int64_t r = 0; r < runs.n; ++r) {
    const T* K = runs.k[r];
    const T* Vr = runs.v[r];
    const int64_t cnt = runs.len[r];
    if (r + 1 < runs.n) {  // NOTE: pages are scattered: the next page's first keys and values, while this one runs
      const int64_t nb = std::min<int64_t>(runs.len[r + 1], ONLINE_PREFETCH_KEYS) * DIM * sizeof(T);
      prefetch_lines<_MM_HINT_T1>(runs.k[r + 1], nb);
      prefetch_lines<_MM_HINT_T1>(runs.v[r + 1], nb);
    }
    for (int64_t j = 0; j < cnt; j += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, cnt - j));
      const T* kb = K + j * DIM;
      const T* vb = Vr + j * DIM;
      if (j + 16 + ONLINE_PREFETCH_KEYS <= cnt) {
        prefetch_lines<_MM_HINT_T1>(kb + ONLINE_PREFETCH_KEYS * DIM, 16 * DIM * sizeof(T));
        prefetch_lines<_MM_HINT_T1>(vb + ONLINE_PREFETCH_KEYS * DIM, 16 * DIM * sizeof(T));
      }
      const __mmask16 live = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
      for (int g = 0; g < GG; ++g) {
        __m512 q[V];
        for (int c = 0; c < V; ++c) q[c] = _mm512_loadu_ps(Q + g * DIM + 16 * c);
        __m512 part[16];
        for (int jj = 0; jj < 16; ++jj) {
          if (jj < n) {
            const T* kj = kb + jj * DIM;
            __m512 a = _mm512_mul_ps(q[0], load16(kj));
            for (int c = 1; c < V; ++c) a = _mm512_fmadd_ps(q[c], load16(kj + 16 * c), a);
            part[jj] = a;
          } else {
            part[jj] = _mm512_setzero_ps();
          }
        }
        const __m512 s16 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(reduce16(part), scale));
        const float bm = _mm512_reduce_max_ps(s16);
        if (bm > mx[g]) {  // NOTE: a new running max: rescale what was summed so far (exp(-inf) = 0 at the start)
          const __m512 f = _mm512_set1_ps(std::exp(mx[g] - bm));
          for (int c = 0; c < V; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], f);
          lsum[g] = _mm512_mul_ps(lsum[g], f);
          mx[g] = bm;
        }
        const __m512 p = _mm512_maskz_mov_ps(live, exp16_nonpos(_mm512_sub_ps(s16, _mm512_set1_ps(mx[g]))));
        lsum[g] = _mm512_add_ps(lsum[g], p);
        _mm512_store_ps(pb[g], p);
      }
      for (int jj = 0; jj < n; ++jj) {
        const T* vj = vb + jj * DIM;
        __m512 vv[V];
        for (int c = 0; c < V; ++c) vv[c] = load16(vj + 16 * c);
        for (int g = 0; g < GG; ++g) {
          const __m512 pp = _mm512_set1_ps(pb[g][jj]);
          for (int c = 0; c < V; ++c) acc[g][c] = _mm512_fmadd_ps(pp, vv[c], acc[g][c]);
        }
      }
    }
  }
  for (int g = 0; g < GG; ++g) {
    const float sum = _mm512_reduce_add_ps(lsum[g]);
    const __m512 rr = _mm512_set1_ps(1.f / sum);
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(O + g * DIM + 16 * c, _mm512_mul_ps(acc[g][c], rr));
    if (lse != nullptr) lse[g] = mx[g] + std::log(sum);
  }
}

inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

// Many query heads against the same keys (a cascade group's shared pages: every head of every member row, M of
// them; `attend` hands it at most 16 at a time): vectorised over the heads, 16 per vector, instead of over the head
// dim. The scores are an outer-product GEMM (4 keys x the heads a step, no horizontal sums) kept key-major [L, MP],
// the softmax runs 16 heads per instruction, and the values stream past the outputs of 16 / (DIM / 16) heads held
// in registers. Equal to `attend_fixed_avx512` up to float rounding (the scale is folded into the queries).
template <int DIM, typename T>
void attend_many_avx512(const float* Q, const Runs<T>& runs, float* O, int64_t M, int64_t L, float sc, float cap,
                        float* rcp, float* lse) {
  const int64_t MV = (M + 15) / 16, MP = MV * 16;
  thread_local std::vector<float> qt_buf, st_buf;
  qt_buf.assign(static_cast<size_t>(DIM * MP + 16), 0.f);
  if (st_buf.size() < static_cast<size_t>(L * MP + 16)) st_buf.resize(static_cast<size_t>(L * MP + 16));
  float* qt = align64(qt_buf.data());  // NOTE: rows of 16 heads on cache lines (unaligned: each load split two lines)
  float* st = align64(st_buf.data());
  for (int64_t g = 0; g < M; ++g)
    for (int d = 0; d < DIM; ++d) qt[d * MP + g] = Q[g * DIM + d] * sc;
  int64_t off = 0;
  for (int64_t r = 0; r < runs.n; ++r) {
    const T* K = runs.k[r];
    const int64_t cnt = runs.len[r];
    if (r + 1 < runs.n) {  // NOTE: the next page's first keys, while this one is scored
      prefetch_lines<_MM_HINT_T0>(runs.k[r + 1], std::min<int64_t>(runs.len[r + 1], 16) * DIM * sizeof(T));
    }
    int64_t j = 0;
    for (; j + 4 <= cnt; j += 4) {
      if (j + 4 + PREFETCH_KEYS <= cnt) {  // NOTE: keys ahead (see attend_fixed_avx512), values into L2
        prefetch_lines<_MM_HINT_T0>(K + (j + PREFETCH_KEYS) * DIM, 4 * DIM * sizeof(T));
      }
      prefetch_lines<_MM_HINT_T1>(runs.v[r] + j * DIM, 4 * DIM * sizeof(T));
      scores_keys<DIM, 4, T>(qt, MV, MP, K + j * DIM, st + (off + j) * MP);
    }
    for (; j < cnt; ++j) scores_keys<DIM, 1, T>(qt, MV, MP, K + j * DIM, st + (off + j) * MP);
    off += cnt;
  }
  if (cap > 0.f) {
    for (int64_t x = 0; x < L * MP; ++x) st[x] = cap * std::tanh(st[x] / cap);
  }
  alignas(64) float mx[16], sm[16];
  for (int64_t v0 = 0; v0 < MV; ++v0) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < L; ++j) m = _mm512_max_ps(m, _mm512_loadu_ps(st + j * MP + 16 * v0));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      float* x = st + j * MP + 16 * v0;
      const __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(x), m));
      _mm512_storeu_ps(x, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_store_ps(mx, m);
    _mm512_store_ps(sm, sum);
    for (int64_t l = 0; l < 16 && 16 * v0 + l < M; ++l) {
      rcp[16 * v0 + l] = 1.f / sm[l];
      if (lse != nullptr) lse[16 * v0 + l] = mx[l] + std::log(sm[l]);
    }
  }
  weighted_values<DIM, T>(runs, st, 1, MP, M, rcp, O);
}
#endif

// Any head size and group: one query head at a time (K and V re-read from cache for the next head).
template <typename T>
void attend_any(const float* Q, const Runs<T>& runs, float* O, int64_t G, int64_t L, int64_t D, float sc, float cap,
                float* s, float* acc, float* r, float* lse) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = Q + g * D;
    int64_t off = 0;
    for (int64_t run = 0; run < runs.n; ++run) {
      const T* K = runs.k[run];
      const int64_t cnt = runs.len[run];
      float* sg = s + g * L + off;
      int64_t j = 0;
      for (; j + 4 <= cnt; j += 4) {  // NOTE: four independent accumulator chains hide the FMA latency
        const T* k0 = K + j * D;
        const T* k1 = k0 + D;
        const T* k2 = k1 + D;
        const T* k3 = k2 + D;
        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t d = 0; d < D; ++d) {
          const float x = qg[d];
          d0 += x * load(k0[d]);
          d1 += x * load(k1[d]);
          d2 += x * load(k2[d]);
          d3 += x * load(k3[d]);
        }
        sg[j] = d0 * sc;
        sg[j + 1] = d1 * sc;
        sg[j + 2] = d2 * sc;
        sg[j + 3] = d3 * sc;
      }
      for (; j < cnt; ++j) {
        const T* kj = K + j * D;
        float d0 = 0.f;
#pragma omp simd reduction(+ : d0)
        for (int64_t d = 0; d < D; ++d) d0 += qg[d] * load(kj[d]);
        sg[j] = d0 * sc;
      }
      off += cnt;
    }
  }
  softmax_rows(s, G, L, cap, r, lse);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    int64_t off = 0;
    for (int64_t run = 0; run < runs.n; ++run) {
      const T* V = runs.v[run];
      const int64_t cnt = runs.len[run];
      const float* sg = s + g * L + off;
      for (int64_t j = 0; j < cnt; ++j) {
        const float pj = sg[j];
        const T* vj = V + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += pj * load(vj[d]);
      }
      off += cnt;
    }
    for (int64_t d = 0; d < D; ++d) O[g * D + d] = acc[d] * r[g];
  }
}

// Specialised (head size, query heads per KV head) pairs: those of common checkpoints (GQA groups of
// 1-8 query heads; head sizes 64, 128 and Gemma's 256); other head counts of those sizes take the AVX-512
// loop with a runtime count (the shared pages of a cascade group); anything else takes `attend_any`.
// From this many query heads on one set of keys (a cascade group's shared pages, a verifying row's tokens), the heads
// are the vector lanes (`attend_many_avx512`); below, the head dim is. 9, not 16: the counts between them (5-7 rows
// of a 5M group, 3-5 of a 100M one, 4-7-token drafts) took the runtime-count loop at 0.67-0.85x the speed
// (`benchmarks/decode_kernel_ab.py --group 3 .. 7`, two runs, Intel Xeon, AVX-512, 2 threads); the specialised counts
// (1-4, 6-8 heads) keep theirs.
constexpr int64_t MANY_HEADS = 9;

// r: [G] scratch; lse: [G] or null (the log-sum-exp of each head's scores, for a cascade merge).
#if defined(__AVX512F__)
// NOTE: one pass (`attend_online_avx512`) where `one_pass_fits` and there is no softcap (its tanh runs on the
// two-pass kernel's stored scores)
#define ROLLOUT_ATTEND_CASE(DIM, GG)                                             \
  if (D == DIM && G == GG) {                                                     \
    if constexpr (one_pass_fits<DIM, GG>()) {                                    \
      if (cap == 0.f) {                                                          \
        attend_online_avx512<DIM, GG, T>(Q, runs, O, sc, lse);                   \
        return;                                                                  \
      }                                                                          \
    }                                                                            \
    attend_fixed_avx512<DIM, GG, T>(Q, runs, O, L, sc, cap, s, lse, r, GG);      \
    return;                                                                      \
  }
#define ROLLOUT_ATTEND_RUNTIME(DIM)                                              \
  if (D == DIM) {                                                                \
    if (G >= MANY_HEADS) {                                                       \
      attend_many_avx512<DIM, T>(Q, runs, O, G, L, sc, cap, r, lse);             \
    } else {                                                                     \
      attend_fixed_avx512<DIM, 0, T>(Q, runs, O, L, sc, cap, s, lse, r, static_cast<int>(G)); \
    }                                                                            \
    return;                                                                      \
  }
#else
#define ROLLOUT_ATTEND_CASE(DIM, GG)                       \
  if (D == DIM && G == GG) {                               \
    attend_fixed<DIM, GG, T>(Q, runs, O, L, sc, cap, s, lse); \
    return;                                                \
  }
#define ROLLOUT_ATTEND_RUNTIME(DIM)
#endif
#define ROLLOUT_ATTEND_DIM(DIM) \
  ROLLOUT_ATTEND_CASE(DIM, 1)   \
  ROLLOUT_ATTEND_CASE(DIM, 2)   \
  ROLLOUT_ATTEND_CASE(DIM, 3)   \
  ROLLOUT_ATTEND_CASE(DIM, 4)   \
  ROLLOUT_ATTEND_CASE(DIM, 6)   \
  ROLLOUT_ATTEND_CASE(DIM, 7)   \
  ROLLOUT_ATTEND_CASE(DIM, 8)

template <typename T>
void attend(const float* Q, const Runs<T>& runs, float* O, int64_t G, int64_t L, int64_t D, float sc, float cap,
            float* s, float* acc, float* r, float* lse) {
  if (L == 0) {  // NOTE: a cascade row whose keys are all shared: no private part (weight exp(-inf) = 0)
    std::fill(O, O + G * D, 0.f);
    if (lse != nullptr) std::fill(lse, lse + G, -INFINITY);
    return;
  }
#if defined(__AVX512F__)
  // NOTE: past 16 heads, 16 at a time, each chunk through the kernel its head count picks (heads are independent):
  // in one call a last vector of a few heads computed every key's scores in 16 lanes (18 heads: 1.8x the score
  // arithmetic of 16), and [L, 32+] scores left L1. Per query of 4 rows x 9 verifying tokens (5M heads, ~450
  // keys, 2 threads, AMD EPYC, warm): 5.6 -> 3.3 us a layer (`benchmarks/decode_kernel_ab.py --verify`).
  if (G > 16 && (D == 64 || D == 128 || D == 256)) {
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
      attend(Q + g0 * D, runs, O + g0 * D, std::min<int64_t>(16, G - g0), L, D, sc, cap, s, acc, r,
             lse == nullptr ? nullptr : lse + g0);
    }
    return;
  }
#endif
  ROLLOUT_ATTEND_DIM(64)
  ROLLOUT_ATTEND_DIM(128)
  ROLLOUT_ATTEND_CASE(256, 1)
  ROLLOUT_ATTEND_CASE(256, 2)
  ROLLOUT_ATTEND_RUNTIME(64)
  ROLLOUT_ATTEND_RUNTIME(128)
  ROLLOUT_ATTEND_RUNTIME(256)
  attend_any(Q, runs, O, G, L, D, sc, cap, s, acc, r, lse);
}

void check_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && out.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && v.sizes() == k.sizes(), "paged_decode_attention: shapes disagree");
  TORCH_CHECK(q.size(2) <= 1024, "paged_decode_attention: head size above 1024");
}

// Cascade groups: decode rows whose page tables name the same physical pages (a GRPO group forked from one
// prompt, prefix-cache hits on the same pages) attend to those shared pages once for all their query heads,
// and to the rest of their keys (`private`) alone; the two partial softmaxes merge by their log-sum-exp.
struct Cascade {
  int64_t first_page;         // logical index of the first shared page (the same in every member)
  int64_t pages;              // shared full pages
  std::vector<int64_t> rows;  // member queries
  int64_t ext_block = -1;     // with `ext_len`: the first `ext_len` slots of this block extend the shared keys
  int64_t ext_len = 0;        // (the prompt's partial last page, which every fork copied from its leader)
};

// The page after a group's shared full pages: when every member reads its first slots from one block, the group
// reads the slots all members read (up to the shortest member's end) once too, from that block. Members name the
// block in their table (the tokens of one verifying row, each a query reading up to its own position; prefix-cache
// hits on a partial page) or read a copy of it: forks copy their leader's partial prompt page (`alias`, [n, 3]
// int64 per query: logical page, block copied from, slots copied; page -1 for none, nullptr for no copies), and a
// fork reads the copied slots from the block they were copied from. The caller vouches that the block still holds
// what was copied (`rollout.model.runner`).
// The `alias` argument's data ([n, 3] int64, contiguous), or nullptr when there is none.
const int64_t* alias_data(const c10::optional<at::Tensor>& alias, int64_t n, const char* who) {
  if (!alias.has_value() || !alias->defined()) return nullptr;
  TORCH_CHECK(alias->scalar_type() == at::kLong && alias->is_contiguous() && alias->dim() == 2 && alias->size(0) == n &&
                  alias->size(1) == 3,
              who, ": alias must be int64 [n, 3] (page, block, slots) per query");
  return alias->data_ptr<int64_t>();
}

// The block query i reads logical page e from (its copy's source where it copied that page) and how many of that
// page's slots it reads there; slots 0 when it reads none.
template <typename I>
std::pair<int64_t, int64_t> page_source(const I* tp, int64_t P, const int64_t* rp, const int64_t* hi,
                                        const int64_t* alias, int64_t ps, int64_t i, int64_t e) {
  int64_t b = static_cast<int64_t>(tp[rp[i] * P + e]), n = std::min(hi[i] - e * ps, ps);
  if (alias != nullptr && alias[3 * i] == e) b = alias[3 * i + 1], n = std::min(n, alias[3 * i + 2]);
  return {b, n};
}

template <typename I>
void extend_cascade(Cascade& c, const I* tp, int64_t P, const int64_t* rp, const int64_t* hi, const int64_t* alias,
                    int64_t ps) {
  const int64_t e = c.first_page + c.pages;
  int64_t block = -1, len = ps;
  bool same = e < P;
  for (size_t x = 0; same && x < c.rows.size(); ++x) {
    const auto [b, n] = page_source(tp, P, rp, hi, alias, ps, c.rows[x], e);
    same = n > 0 && (block < 0 || b == block);
    block = b;
    len = std::min(len, n);
  }
  if (same) c.ext_block = block, c.ext_len = len;
}

template <typename I>
void extend_cascades(std::vector<Cascade>& groups, const I* tp, int64_t P, const int64_t* rp, const int64_t* hi,
                     const int64_t* alias, int64_t ps) {
  for (Cascade& c : groups) extend_cascade(c, tp, P, rp, hi, alias, ps);
}

// Queries in no group whose keys from their first page boundary on lie in one partial page, read from the same
// block (the tokens of a verifying row whose context has no full page yet; forks of a prompt shorter than a page):
// groups of no full pages that share those slots (`extend_cascades`'s extension alone).
template <typename I>
void add_partial_cascades(std::vector<Cascade>& groups, const I* tp, int64_t P, const int64_t* rp, const int64_t* lo,
                          const int64_t* hi, const int64_t* alias, int64_t n, int64_t ps) {
  std::vector<char> grouped(n, 0);
  for (const Cascade& c : groups)
    for (int64_t i : c.rows) grouped[i] = 1;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> keyed;  // (first page, block, query)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = (lo[i] + ps - 1) / ps;
    if (grouped[i] || hi[i] <= e * ps || hi[i] / ps > e || e >= P) continue;  // NOTE: no slots there, or full pages
    keyed.emplace_back(e, page_source(tp, P, rp, hi, alias, ps, i, e).first, i);
  }
  std::sort(keyed.begin(), keyed.end());
  for (size_t a = 0; a < keyed.size();) {
    size_t b = a;
    while (b < keyed.size() && std::get<0>(keyed[b]) == std::get<0>(keyed[a]) &&
           std::get<1>(keyed[b]) == std::get<1>(keyed[a]))
      ++b;
    if (b - a >= 2) {
      Cascade c{std::get<0>(keyed[a]), 0, {}};
      for (size_t x = a; x < b; ++x) c.rows.push_back(std::get<2>(keyed[x]));
      extend_cascade(c, tp, P, rp, hi, alias, ps);
      groups.push_back(c);
    }
    a = b;
  }
}

// Only full pages inside every member's range are shared. Rows are sorted by their full pages' block ids;
// runs of rows that start on the same block are split greedily where keeping a row in the group would read
// more keys (the group's common prefix shrinks for every member) than taking it out.
template <typename I>
std::vector<Cascade> plan_cascades(const I* tp, int64_t P, const int64_t* rp, const int64_t* lo, const int64_t* hi,
                                   int64_t n, int64_t ps) {
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < n; ++i) {
    if (hi[i] / ps > (lo[i] + ps - 1) / ps) idx.push_back(i);
  }
  auto first = [&](int64_t i) { return (lo[i] + ps - 1) / ps; };
  auto full = [&](int64_t i) { return hi[i] / ps - first(i); };
  auto blocks = [&](int64_t i) { return tp + rp[i] * P + first(i); };
  std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
    if (first(a) != first(b)) return first(a) < first(b);
    return std::lexicographical_compare(blocks(a), blocks(a) + full(a), blocks(b), blocks(b) + full(b));
  });
  std::vector<Cascade> out;
  Cascade cur{0, 0, {}};
  int64_t sum_full = 0;  // full pages of the current group's members
  auto close = [&]() {
    if (cur.rows.size() >= 2 && cur.pages >= 1) out.push_back(cur);
    cur.rows.clear();
  };
  for (size_t x = 0; x < idx.size(); ++x) {
    const int64_t i = idx[x], f = full(i);
    if (!cur.rows.empty()) {
      const int64_t prev = cur.rows.back();
      int64_t common = 0;
      if (first(prev) == first(i)) {
        const int64_t lim = std::min(cur.pages, f);
        while (common < lim && blocks(prev)[common] == blocks(i)[common]) ++common;
      }
      const int64_t m = static_cast<int64_t>(cur.rows.size());
      const int64_t join = common + sum_full + f - (m + 1) * common;  // keys read (in pages) if i joins
      const int64_t split = cur.pages + sum_full - m * cur.pages + f;  // if i starts a new group
      if (common >= 1 && join <= split) {
        cur.pages = common;
        cur.rows.push_back(i);
        sum_full += f;
        continue;
      }
      close();
    }
    cur.first_page = first(i);
    cur.pages = f;
    cur.rows.assign(1, i);
    sum_full = f;
  }
  close();
  return out;
}

// Every cascade group of a step: full pages (`plan_cascades`), each run on into a partial page its members read from
// one block (`extend_cascades`), then rows of no full page sharing one (`add_partial_cascades`).
template <typename I>
std::vector<Cascade> cascade_groups(const I* tp, int64_t P, const int64_t* rp, const int64_t* lo, const int64_t* hi,
                                    const int64_t* alias, int64_t n, int64_t ps) {
  std::vector<Cascade> groups = plan_cascades(tp, P, rp, lo, hi, n, ps);
  extend_cascades(groups, tp, P, rp, hi, alias, ps);
  add_partial_cascades(groups, tp, P, rp, lo, hi, alias, n, ps);
  return groups;
}

// Paged cache: k, v [Hkv, slots, D] (head-major, slot = block * page_size + offset); query i reads
// positions start[i] .. end[i] - 1 through row row[i] of the block table table ([R, P] block ids, int32
// or int64: the engine's persistent table, or one row per query).
// K/V are fp32, bf16 or fp16 (widened to fp32 as they are read); q and out are fp32.
// Work items are (query, KV head) and, with `cascade`, (cascade group, KV head) for the shared pages; they go
// to torch's threads longest first, each to the least loaded thread. Each item's result is independent of
// the thread that runs it, so the output is the same at any thread count.
template <typename T, typename I>
void paged_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size, float sc,
                float cap, bool cascade, const int64_t* alias, at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k.size(0), S = k.size(1), R = table.size(0), P = table.size(1);
  const int64_t G = H / Hkv, blocks = S / page_size;
  const I* tp = table.data_ptr<I>();
  const int64_t* rp = row.data_ptr<int64_t>();
  const int64_t* sp = start.data_ptr<int64_t>();
  const int64_t* ep = end.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < R, "paged_decode_attention: table row out of range");
    TORCH_CHECK(sp[i] >= 0 && ep[i] > sp[i] && ep[i] <= P * page_size,
                "paged_decode_attention: positions out of range");
    const I* t = tp + rp[i] * P;
    for (int64_t p = sp[i] / page_size; p <= (ep[i] - 1) / page_size; ++p) {
      TORCH_CHECK(t[p] >= 0 && t[p] < blocks, "paged_decode_attention: block id out of range");
    }
    if (alias != nullptr && alias[3 * i] >= 0) {
      TORCH_CHECK(alias[3 * i + 1] >= 0 && alias[3 * i + 1] < blocks && alias[3 * i + 2] >= 0 &&
                      alias[3 * i + 2] <= page_size,
                  "paged_decode_attention: alias block or slots out of range");
    }
  }
  const float* qp = q.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t ps = page_size;

  std::vector<Cascade> groups;
  if (cascade) groups = cascade_groups(tp, P, rp, sp, ep, alias, n, ps);
  // Per query: its cascade group (-1: none) and member index; shared outputs [sum m * H, D] by group.
  std::vector<int64_t> group_of(n, -1), member(n, 0), head0(groups.size() + 1, 0);
  for (size_t c = 0; c < groups.size(); ++c) {
    for (size_t j = 0; j < groups[c].rows.size(); ++j) {
      group_of[groups[c].rows[j]] = static_cast<int64_t>(c);
      member[groups[c].rows[j]] = static_cast<int64_t>(j);
    }
    head0[c + 1] = head0[c] + static_cast<int64_t>(groups[c].rows.size()) * H;
  }
  std::vector<float> shared_out(head0.back() * D), shared_lse(head0.back()), private_lse(groups.empty() ? 0 : n * H);

  struct Item {
    int64_t index;  // query (< n) or n + cascade group
    int64_t h;      // KV head
    double cost;
  };
  std::vector<Item> items;
  items.reserve(n * Hkv + groups.size() * Hkv);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = group_of[i];
    const int64_t keys = ep[i] - sp[i] - (c < 0 ? 0 : groups[c].pages * ps + groups[c].ext_len);
    for (int64_t h = 0; h < Hkv; ++h) items.push_back({i, h, static_cast<double>(keys) + 16.0});
  }
  for (size_t c = 0; c < groups.size(); ++c) {
    const double heads = static_cast<double>(groups[c].rows.size() * G);
    const double keys = static_cast<double>(groups[c].pages * ps + groups[c].ext_len);
    for (int64_t h = 0; h < Hkv; ++h) items.push_back({n + static_cast<int64_t>(c), h, keys * (1.0 + heads / 16.0)});
  }
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<std::vector<Item>> plan(workers);
  if (workers == 1) {
    plan[0] = items;
  } else {
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    std::vector<double> load(workers, 0.0);
    for (const Item& it : items) {
      const int64_t w = std::min_element(load.begin(), load.end()) - load.begin();
      plan[w].push_back(it);
      load[w] += it.cost;
    }
    // NOTE: odd threads run their items shortest first: a cascade's shared pages (few bytes, many FLOPs) then
    // overlap other threads' private keys (memory-bound) instead of every thread computing, then every thread
    // streaming (the order changes no result)
    for (int64_t w = 1; w < workers; w += 2) std::reverse(plan[w].begin(), plan[w].end());
  }
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    std::vector<float> s, qbuf, r(H), acc(D);
    std::vector<const T*> kr, vr;
    std::vector<int64_t> lens;
    // The K/V element offset of position pos of table row t, for KV head h.
    auto slot_row = [&](const I* t, int64_t h, int64_t pos) {
      return (h * S + static_cast<int64_t>(t[pos / ps]) * ps + pos % ps) * D;
    };
    // The runs of positions [a, b) of table row t, for KV head h.
    auto add = [&](const I* t, int64_t h, int64_t a, int64_t b) {
      for (int64_t pos = a; pos < b;) {
        const int64_t cnt = std::min(ps - pos % ps, b - pos);
        const int64_t row = slot_row(t, h, pos);
        kr.push_back(kp + row);
        vr.push_back(vp + row);
        lens.push_back(cnt);
        pos += cnt;
      }
    };
    // The first K/V row an item reads (its first run's start in `add`), or -1 when it reads none.
    auto first_row = [&](const Item& it) -> int64_t {
      int64_t i = 0, pos = 0;
      if (it.index < n) {
        i = it.index;
        const int64_t c = group_of[i];
        pos = sp[i];
        if (c >= 0 && pos >= groups[c].first_page * ps) {
          pos = (groups[c].first_page + groups[c].pages) * ps + groups[c].ext_len;
        }
        if (pos >= ep[i]) return -1;
      } else {
        const Cascade& cg = groups[it.index - n];
        i = cg.rows[0];
        pos = cg.first_page * ps;
      }
      return slot_row(tp + rp[i] * P, it.h, pos);
    };
    for (int64_t w = first; w < last; ++w) {
      for (size_t x = 0; x < plan[w].size(); ++x) {
        const Item& it = plan[w][x];
        const int64_t h = it.h;
#if defined(__AVX512F__)
        if (x + 1 < plan[w].size()) {  // NOTE: the next item's first keys and values, into L2 while this one runs
          const int64_t next = first_row(plan[w][x + 1]);
          if (next >= 0) {
            prefetch_lines<_MM_HINT_T1>(kp + next, ONLINE_PREFETCH_KEYS * D * sizeof(T));
            prefetch_lines<_MM_HINT_T1>(vp + next, ONLINE_PREFETCH_KEYS * D * sizeof(T));
          }
        }
#endif
        kr.clear();
        vr.clear();
        lens.clear();
        if (it.index < n) {
          const int64_t i = it.index, c = group_of[i];
          const I* t = tp + rp[i] * P;
          float* lse = nullptr;
          if (c < 0) {
            add(t, h, sp[i], ep[i]);
          } else {  // NOTE: the keys before and after the shared pages
            add(t, h, sp[i], groups[c].first_page * ps);
            add(t, h, (groups[c].first_page + groups[c].pages) * ps + groups[c].ext_len, ep[i]);
            lse = private_lse.data() + i * H + h * G;
          }
          int64_t L = 0;
          for (int64_t x : lens) L += x;
          if (static_cast<int64_t>(s.size()) < G * L) s.resize(G * L);
          const Runs<T> runs{kr.data(), vr.data(), lens.data(), static_cast<int64_t>(lens.size())};
          const int64_t qo = (i * H + h * G) * D;
          attend(qp + qo, runs, op + qo, G, L, D, sc, cap, s.data(), acc.data(), r.data(), lse);
        } else {  // NOTE: the shared pages once for every query head of the group: [m * G, D] queries
          const Cascade& cg = groups[it.index - n];
          const int64_t m = static_cast<int64_t>(cg.rows.size()), M = m * G;
          add(tp + rp[cg.rows[0]] * P, h, cg.first_page * ps, (cg.first_page + cg.pages) * ps);
          if (cg.ext_len > 0) {  // NOTE: the copied slots of the partial page, from the block they were copied from
            const int64_t slot_row = (h * S + cg.ext_block * ps) * D;
            kr.push_back(kp + slot_row);
            vr.push_back(vp + slot_row);
            lens.push_back(cg.ext_len);
          }
          const int64_t L = cg.pages * ps + cg.ext_len;
          if (static_cast<int64_t>(s.size()) < M * L) s.resize(M * L);
          if (static_cast<int64_t>(qbuf.size()) < M * D) qbuf.resize(M * D);
          if (static_cast<int64_t>(r.size()) < M) r.resize(M);
          for (int64_t j = 0; j < m; ++j) {
            std::memcpy(qbuf.data() + j * G * D, qp + (cg.rows[j] * H + h * G) * D, G * D * sizeof(float));
          }
          const Runs<T> runs{kr.data(), vr.data(), lens.data(), static_cast<int64_t>(lens.size())};
          const int64_t base = head0[it.index - n] + h * M;  // this head's [M] block of the group's outputs
          attend(qbuf.data(), runs, shared_out.data() + base * D, M, L, D, sc, cap, s.data(), acc.data(), r.data(),
                 shared_lse.data() + base);
        }
      }
    }
  });
  if (groups.empty()) return;
  // Merge: out = (e^{lse_p} out_p + e^{lse_s} out_s) / (e^{lse_p} + e^{lse_s}), per query head.
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t c = group_of[i];
      if (c < 0) continue;
      const int64_t M = static_cast<int64_t>(groups[c].rows.size()) * G;
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t pi = i * H + h * G + g, si = head0[c] + h * M + member[i] * G + g;
          const float a = private_lse[pi], b = shared_lse[si], mx = std::max(a, b);
          const float wa = std::exp(a - mx), wb = std::exp(b - mx), rs = 1.f / (wa + wb);
          float* o = op + pi * D;
          const float* os = shared_out.data() + si * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] = (wa * o[d] + wb * os[d]) * rs;
        }
      }
    }
  });
}

template <typename T>
void paged_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                    const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size, float sc,
                    float cap, bool cascade, const int64_t* alias, at::Tensor& out) {
  if (table.scalar_type() == at::kInt) {
    paged_impl<T, int32_t>(q, k, v, table, row, start, end, page_size, sc, cap, cascade, alias, out);
  } else {
    paged_impl<T, int64_t>(q, k, v, table, row, start, end, page_size, sc, cap, cascade, alias, out);
  }
}

void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                      const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size,
                      double scale, double softcap, bool cascade, const c10::optional<at::Tensor>& alias,
                      at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention: fp32 queries and output only");
  const auto kt = k.scalar_type();
  TORCH_CHECK(v.scalar_type() == kt && (kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf),
              "paged_decode_attention: fp32, bf16 or fp16 cache only");
  check_layout(q, k, v, out);
  TORCH_CHECK(k.dim() == 3, "paged_decode_attention: the cache must be [Hkv, slots, D]");
  TORCH_CHECK((table.scalar_type() == at::kInt || table.scalar_type() == at::kLong) && table.dim() == 2 &&
                  table.is_contiguous(),
              "paged_decode_attention: int32 or int64 block table [R, P]");
  TORCH_CHECK(row.scalar_type() == at::kLong && start.scalar_type() == at::kLong && end.scalar_type() == at::kLong &&
                  row.is_contiguous() && start.is_contiguous() && end.is_contiguous(),
              "paged_decode_attention: int64 rows and positions");
  const int64_t n = q.size(0);
  TORCH_CHECK(k.size(2) == q.size(2) && q.size(1) % k.size(0) == 0, "paged_decode_attention: shapes disagree");
  TORCH_CHECK(row.numel() == n && start.numel() == n && end.numel() == n,
              "paged_decode_attention: one table row and one start and end per query");
  TORCH_CHECK(page_size >= 1 && k.size(1) % page_size == 0, "paged_decode_attention: bad page size");
  const int64_t* ap = alias_data(alias, n, "paged_decode_attention");
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (kt == at::kFloat) {
    paged_dispatch<float>(q, k, v, table, row, start, end, page_size, sc, cap, cascade, ap, out);
  } else if (kt == at::kBFloat16) {
    paged_dispatch<uint16_t>(q, k, v, table, row, start, end, page_size, sc, cap, cascade, ap, out);
  } else {
    paged_dispatch<_Float16>(q, k, v, table, row, start, end, page_size, sc, cap, cascade, ap, out);
  }
}

// Each query row alone (the reference the cascade is tested against). `alias` is accepted and not needed: each
// row reads its own copy of the slots it names (the engine hands either kernel the same arguments).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                            const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size,
                            double scale, double softcap, at::Tensor& out, const c10::optional<at::Tensor>& alias) {
  decode_attention(q, k, v, table, row, start, end, page_size, scale, softcap, false, c10::nullopt, out);
}

// Rows that share full pages (same block ids) read them once as a group (see `Cascade`); with `alias`, the
// slots their forks copied from one partial page too (see `extend_cascades`).
void cascade_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                              const at::Tensor& row, const at::Tensor& start, const at::Tensor& end,
                              int64_t page_size, double scale, double softcap, at::Tensor& out,
                              const c10::optional<at::Tensor>& alias) {
  decode_attention(q, k, v, table, row, start, end, page_size, scale, softcap, true, alias, out);
}

// The cascade groups the kernel would form (tests): (first shared page, shared full pages, member queries, block
// whose first slots extend the shared keys or -1, how many slots) each.
std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>, int64_t, int64_t>> cascade_plan(
    const at::Tensor& table, const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size,
    const c10::optional<at::Tensor>& alias) {
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous() &&
                  row.scalar_type() == at::kLong && start.scalar_type() == at::kLong &&
                  end.scalar_type() == at::kLong && row.is_contiguous() && start.is_contiguous() && end.is_contiguous(),
              "cascade_plan: int64 tensors");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* rp = row.data_ptr<int64_t>();
  const int64_t* ep = end.data_ptr<int64_t>();
  const int64_t* ap = alias_data(alias, row.numel(), "cascade_plan");
  auto groups = cascade_groups(tp, table.size(1), rp, start.data_ptr<int64_t>(), ep, ap, row.numel(), page_size);
  std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>, int64_t, int64_t>> out;
  for (const auto& g : groups) out.emplace_back(g.first_page, g.pages, g.rows, g.ext_block, g.ext_len);
  return out;
}

// How many threads an at::parallel_for over `items` items runs on in this build: 1 unless the file was
// compiled with OpenMP (ATen's parallel_for is inline; without -fopenmp it is a plain loop).
int64_t parallel_threads(int64_t items) {
  std::vector<int64_t> tid(std::max<int64_t>(items, 1), 0);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) tid[i] = at::get_thread_num();
  });
  return static_cast<int64_t>(std::set<int64_t>(tid.begin(), tid.end()).size());
}
