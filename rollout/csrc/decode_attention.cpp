// Decode attention over the paged KV cache, for CPUs.
//
// One query token per request. For each (request, KV head) the keys and the values are streamed
// once from memory for all the query heads that share that KV head (GQA), so the cost is one read
// of the request's K and V: the bound this op cannot beat. torch's CPU SDPA reads them once per
// query head and runs per-head GEMM calls with one row, at a third to a half of that bandwidth.
// Head sizes 64 and 128 with 1-4, 6, 7 or 8 query heads per KV head, and 256 with 1 or 2, have
// specialisations that keep each head's accumulators together; anything else takes a generic loop.
//
// Layouts (contiguous):
//   q     [n, H, D] fp32        one query per request
//   k, v  [Hkv, slots, D]       the paged cache, head-major, slot = block * page_size + offset;
//                               fp32, bf16 or fp16 (half precision widened to fp32 as it is read)
//   table [n, P] int64          block table of each request; it reads positions start[i] .. end[i] - 1
//   out   [n, H, D] fp32
// softcap > 0 applies Gemma 2's cap * tanh(score / cap) to the scaled scores.
// The result equals softmax(q K^T * scale) V up to float rounding (not bitwise equal to torch's SDPA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <set>
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
void attend_fixed(const float* Q, const Runs<T>& runs, float* O, int64_t L, float sc, float cap, float* s) {
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
  softmax_rows(s, GG, L, cap, r);
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

template <int DIM, int GG, typename T>
void attend_fixed_avx512(const float* Q, const Runs<T>& runs, float* O, int64_t L, float sc, float cap, float* s) {
  constexpr int V = DIM / 16;  // vectors per row
  const __m512 scale = _mm512_set1_ps(sc);
  int64_t off = 0;
  for (int64_t r = 0; r < runs.n; ++r) {
    const T* K = runs.k[r];
    const T* Vp = runs.v[r];
    const int64_t cnt = runs.len[r];
    if (r + 1 < runs.n) {  // NOTE: pages are scattered: fetch the next page's first keys while this one is scored
      const char* nk = reinterpret_cast<const char*>(runs.k[r + 1]);
      const int64_t nb = std::min<int64_t>(runs.len[r + 1], 16) * DIM * sizeof(T);
      for (int64_t b = 0; b < nb; b += 64) _mm_prefetch(nk + b, _MM_HINT_T0);
    }
    int64_t j = 0;
    for (; j + 16 <= cnt; j += 16) {
      const T* kb = K + j * DIM;
      // NOTE: the values of these keys are read right after the scores: start fetching them into L2 now
      const char* vb = reinterpret_cast<const char*>(Vp + j * DIM);
      for (int64_t b = 0; b < static_cast<int64_t>(16 * DIM * sizeof(T)); b += 64) _mm_prefetch(vb + b, _MM_HINT_T1);
      for (int g = 0; g < GG; ++g) {
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
      for (int g = 0; g < GG; ++g) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(Q + g * DIM), load16(kj));
        for (int c = 1; c < V; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(Q + g * DIM + 16 * c), load16(kj + 16 * c), a);
        s[g * L + off + j] = _mm512_reduce_add_ps(a) * sc;
      }
    }
    off += cnt;
  }
  float rcp[GG];
  softmax_rows(s, GG, L, cap, rcp);
  constexpr int HB = (16 / V) > 0 ? (16 / V) : 1;  // heads whose outputs stay in registers together
  for (int g0 = 0; g0 < GG; g0 += HB) {
    const int gn = std::min(HB, GG - g0);
    __m512 acc[HB][V];
    for (int g = 0; g < HB; ++g)
      for (int c = 0; c < V; ++c) acc[g][c] = _mm512_setzero_ps();
    off = 0;
    for (int64_t run = 0; run < runs.n; ++run) {
      const T* Vr = runs.v[run];
      const int64_t cnt = runs.len[run];
      for (int64_t jj = 0; jj < cnt; ++jj) {
        const T* vj = Vr + jj * DIM;
        __m512 vv[V];
        for (int c = 0; c < V; ++c) vv[c] = load16(vj + 16 * c);
        for (int g = 0; g < HB; ++g) {
          if (g >= gn) break;
          const __m512 p = _mm512_set1_ps(s[(g0 + g) * L + off + jj]);
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
#define ROLLOUT_ATTEND_FIXED attend_fixed_avx512
#else
#define ROLLOUT_ATTEND_FIXED attend_fixed
#endif

// Any head size and group: one query head at a time (K and V re-read from cache for the next head).
template <typename T>
void attend_any(const float* Q, const Runs<T>& runs, float* O, int64_t G, int64_t L, int64_t D, float sc, float cap,
                float* s, float* acc) {
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
  std::vector<float> r(G);
  softmax_rows(s, G, L, cap, r.data());
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
// 1-8 query heads; head sizes 64, 128 and Gemma's 256); anything else takes `attend_any`.
#define ROLLOUT_ATTEND_CASE(DIM, GG)                     \
  if (D == DIM && G == GG) {                             \
    ROLLOUT_ATTEND_FIXED<DIM, GG, T>(Q, runs, O, L, sc, cap, s); \
    return;                                              \
  }
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
            float* s, float* acc) {
  ROLLOUT_ATTEND_DIM(64)
  ROLLOUT_ATTEND_DIM(128)
  ROLLOUT_ATTEND_CASE(256, 1)
  ROLLOUT_ATTEND_CASE(256, 2)
  attend_any(Q, runs, O, G, L, D, sc, cap, s, acc);
}

void check_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && out.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && v.sizes() == k.sizes(), "paged_decode_attention: shapes disagree");
  TORCH_CHECK(q.size(2) <= 1024, "paged_decode_attention: head size above 1024");
}

// Paged cache: k, v [Hkv, slots, D] (head-major, slot = block * page_size + offset); query i reads
// positions start[i] .. end[i] - 1 through row row[i] of the block table table ([R, P] block ids, int32
// or int64: the engine's persistent table, or one row per query).
// K/V are fp32, bf16 or fp16 (widened to fp32 as they are read); q and out are fp32.
// Work items (query, KV head) go round-robin to torch's threads, so rows of unequal length spread evenly.
template <typename T, typename I>
void paged_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size, float sc,
                float cap, at::Tensor& out) {
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
  }
  const float* qp = q.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t items = n * Hkv;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    std::vector<float> s;
    std::vector<float> acc(D);
    std::vector<const T*> kr, vr;
    std::vector<int64_t> lens;
    for (int64_t w = first; w < last; ++w) {
      for (int64_t item = w; item < items; item += workers) {
        const int64_t i = item / Hkv, h = item % Hkv;
        const int64_t lo = sp[i], hi = ep[i], L = hi - lo;
        const I* t = tp + rp[i] * P;
        kr.clear();
        vr.clear();
        lens.clear();
        for (int64_t pos = lo; pos < hi;) {
          const int64_t page = pos / page_size, offset = pos % page_size;
          const int64_t cnt = std::min(page_size - offset, hi - pos);
          const int64_t slot_row = (h * S + static_cast<int64_t>(t[page]) * page_size + offset) * D;
          kr.push_back(kp + slot_row);
          vr.push_back(vp + slot_row);
          lens.push_back(cnt);
          pos += cnt;
        }
        if (static_cast<int64_t>(s.size()) < G * L) s.resize(G * L);
        const Runs<T> runs{kr.data(), vr.data(), lens.data(), static_cast<int64_t>(lens.size())};
        const int64_t qo = (i * H + h * G) * D;
        attend(qp + qo, runs, op + qo, G, L, D, sc, cap, s.data(), acc.data());
      }
    }
  });
}

template <typename T>
void paged_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                    const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size, float sc,
                    float cap, at::Tensor& out) {
  if (table.scalar_type() == at::kInt) {
    paged_impl<T, int32_t>(q, k, v, table, row, start, end, page_size, sc, cap, out);
  } else {
    paged_impl<T, int64_t>(q, k, v, table, row, start, end, page_size, sc, cap, out);
  }
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                            const at::Tensor& row, const at::Tensor& start, const at::Tensor& end, int64_t page_size,
                            double scale, double softcap, at::Tensor& out) {
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
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (kt == at::kFloat) {
    paged_dispatch<float>(q, k, v, table, row, start, end, page_size, sc, cap, out);
  } else if (kt == at::kBFloat16) {
    paged_dispatch<uint16_t>(q, k, v, table, row, start, end, page_size, sc, cap, out);
  } else {
    paged_dispatch<_Float16>(q, k, v, table, row, start, end, page_size, sc, cap, out);
  }
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

// Every entry point releases the GIL: the arguments are converted first, and no Python object is
// touched inside (the caller's other Python threads run during the call).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged cache (CPU)",
        release());
  m.def("parallel_threads", &parallel_threads, "threads an at::parallel_for runs on (tests)", release());
}
