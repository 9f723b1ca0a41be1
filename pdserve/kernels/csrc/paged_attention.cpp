// Paged attention for CPU: reads K/V where they lie in the block cache, one pass per sequence.
//
// One call covers a whole step: decode tokens and prefill chunks (with or without a cached prefix)
// side by side, described vLLM-style by query_start_loc (where each sequence's queries start in the
// flat batch) and seq_lens (each sequence's context length, this step's tokens included). Query i of
// a sequence with n queries and context L sits at position L - n + i and sees keys 0 .. L - n + i.
//
// Work is split over (sequence, KV head, tile of queries); all query heads of one KV head are done
// together, so each K/V block is read once per group (GQA without repeating K/V). Scores go through
// an online softmax per cache block, as in flash attention. Math is fp32 whatever the cache dtype.
//
// Two inner loops, both written with GCC vector extensions (16 floats: one AVX-512 register, two
// AVX2 ones, four NEON ones), so one source serves every CPU the build runs on:
// - a tile with few rows (decode: one token's query heads) scores the whole context straight from the
//   cache rows, takes one exact softmax, then sums V with its accumulators in registers; it is bound by
//   memory bandwidth;
// - a tile with many rows (a prefill chunk) first widens the block to fp32, K transposed, so the
//   score loop runs over 16 tokens at a time with the query broadcast; over a bf16 cache on a CPU
//   with AVX512_BF16 it keeps K/V in bf16 pairs and uses the native bf16 dot product instead.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {

using namespace pdserve;

constexpr int64_t kRowsPerTile = 192;  // query rows (tokens x heads of one group) per work item
constexpr int64_t kFewRows = 8;       // tiles up to this many rows read the cache directly

struct WorkItem {
  int32_t seq;
  int32_t kv_head;   // the first of num_kv_heads (more than one only on the few-rows path)
  int32_t num_kv_heads;
  int32_t first_query;  // within the sequence
  int32_t num_queries;
};

struct Scratch {
  std::vector<float> q, acc, k_t, v, scores, row_max, row_sum;
  std::vector<int64_t> offsets;  // the few-rows path's token offsets into the cache
  std::vector<f32x16> dots;      // and its partial dot products, 16 tokens per row
  std::vector<uint16_t> q_bf16, k_pairs, v_pairs, p_bf16;  // the native-bf16 path's operands
  void fit(int64_t rows, int64_t head_dim, int64_t block_size) {
    const int64_t padded = (block_size + kLanes - 1) / kLanes * kLanes;
    q_bf16.resize(rows * head_dim);
    k_pairs.resize(head_dim * padded);
    v_pairs.resize((padded + 2) * head_dim);
    p_bf16.resize(padded + kLanes);
    q.resize(rows * head_dim);
    acc.resize(rows * head_dim);
    k_t.resize(head_dim * padded);
    v.resize(block_size * head_dim);
    if (static_cast<int64_t>(scores.size()) < rows * padded) scores.resize(rows * padded);  // few rows grow it more
    row_max.resize(rows);
    row_sum.resize(rows);
  }
};

struct Geometry {  // what every work item of one call shares
  int64_t q_tok_stride, q_head_stride, kv_block_stride, kv_tok_stride, kv_head_stride;
  int64_t group, head_dim, block_size, out_tok_stride;
  float scale;
};

// Online-softmax update of one row with this block's raw scores sc[0..n); sc becomes the weights.
inline void softmax_step(float* sc, int64_t n, float& row_max, float& row_sum, float* acc, int64_t head_dim) {
  float m = row_max;
  for (int64_t t = 0; t < n; ++t) m = std::max(m, sc[t]);
  const float alpha = std::exp(row_max - m);  // exp(-inf) = 0 on the first block
  row_sum = row_sum * alpha + exp_sum(sc, n, m);
  row_max = m;
  if (alpha != 1.f)
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= alpha;
}

// Few rows (a decode token's query heads, or a short chunk's), for `heads` KV heads side by side: every
// score of the context first, then one exact softmax per row, then the weighted sum of V with the
// accumulators in registers. K is read once for all rows of a head, 16 tokens' dot products are summed
// by one transpose tree, and all heads of a token are read together: a block's rows are adjacent in the
// cache, so one work item streams each block front to back, which the hardware prefetcher follows
// (reading one head's 128-byte slices of a scattered block ran at a third of the bandwidth).
// Row (h * ROWS + r) is head h's row r in s.q, s.scores, s.acc and s.row_sum.

// The cache offset of each of the first n tokens (first head): no division in the token loops.
inline void token_offsets(Scratch& s, const Geometry& g, const int32_t* block_table, int64_t kv_head, int64_t n) {
  s.offsets.resize(n);
  for (int64_t t0 = 0, j = 0; t0 < n; t0 += g.block_size, ++j) {
    const int64_t base = static_cast<int64_t>(block_table[j]) * g.kv_block_stride + kv_head * g.kv_head_stride;
    for (int64_t t = t0; t < std::min(n, t0 + g.block_size); ++t) s.offsets[t] = base + (t - t0) * g.kv_tok_stride;
  }
}

// The cache lies in DRAM during a decode step (each layer's K/V is read once per step) and a sequence's
// blocks are scattered: ask for token t's rows of all `heads` a little ahead of their use.
template <typename T>
inline void prefetch_token(const Scratch& s, const Geometry& g, const T* cache, int64_t heads, int64_t t) {
  const char* p = reinterpret_cast<const char*>(cache + s.offsets[t]);
  const int64_t bytes = ((heads - 1) * g.kv_head_stride + g.head_dim) * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// Head h's dot products of token t with its ROWS queries, one 16-lane partial-sum vector per row.
template <typename T, int ROWS>
inline void dot_rows(const Scratch& s, const Geometry& g, const T* kr, int64_t h, f32x16* d) {
  const float* q = s.q.data() + h * ROWS * g.head_dim;
  for (int64_t c = 0; c < g.head_dim / kLanes; ++c) {
    const f32x16 kc = load16(kr + c * kLanes);
    for (int r = 0; r < ROWS; ++r) d[r] += load16(q + r * g.head_dim + c * kLanes) * kc;
  }
}

#if defined(__AVX512BF16__)
// The same with native bf16 dot products on the model's own bf16 query (the scale comes after).
template <int ROWS>
inline void dot_rows_bf16(const Scratch& s, const Geometry& g, const c10::BFloat16* kr, int64_t h, f32x16* d) {
  const uint16_t* q = s.q_bf16.data() + h * ROWS * g.head_dim;
  __m512 a[ROWS];
  for (int r = 0; r < ROWS; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < g.head_dim; c += 32) {
    const __m512bh kc = (__m512bh)_mm512_loadu_si512(kr + c);
    for (int r = 0; r < ROWS; ++r)
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(q + r * g.head_dim + c), kc);
  }
  for (int r = 0; r < ROWS; ++r) d[r] = (f32x16)a[r] * g.scale;
}
#endif

template <typename T, int ROWS>
void few_scores(Scratch& s, const Geometry& g, const T* k, int64_t heads, int64_t n, int64_t stride) {
  const int64_t rows = heads * ROWS;
  s.dots.resize(rows * kLanes);
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    for (int64_t i = 0; i < kLanes; ++i) {
      if (t0 + i + kLanes < n) prefetch_token(s, g, k, heads, t0 + i + kLanes);
      for (int64_t h = 0; h < heads; ++h) {
        f32x16 d[ROWS] = {};
        if (t0 + i < n) {
          const T* kr = k + s.offsets[t0 + i] + h * g.kv_head_stride;
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (g.head_dim % 32 == 0)
              dot_rows_bf16<ROWS>(s, g, kr, h, d);
            else
              dot_rows<T, ROWS>(s, g, kr, h, d);
          } else {
            dot_rows<T, ROWS>(s, g, kr, h, d);
          }
#else
          dot_rows<T, ROWS>(s, g, kr, h, d);
#endif
        }
        for (int r = 0; r < ROWS; ++r) s.dots[(h * ROWS + r) * kLanes + i] = d[r];
      }
    }
    for (int64_t r = 0; r < rows; ++r) store16(s.scores.data() + r * stride + t0, reduce16(&s.dots[r * kLanes]));
  }
}

// sc[0, n) become exp(sc - max) and sc[n, padded) zero; returns their sum.
inline float exact_softmax(float* sc, int64_t n, int64_t padded) {
  f32x16 mv = splat(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) mv = vmax(mv, load16(sc + t));
  float m = hmax(mv);
  for (; t < n; ++t) m = std::max(m, sc[t]);
  const float sum = exp_sum(sc, n, m);
  std::fill(sc + n, sc + padded, 0.f);
  return sum;
}

template <typename T, int ROWS>
void few_values(Scratch& s, const Geometry& g, const T* v, int64_t heads, int64_t n, int64_t stride) {
  constexpr int64_t kTile = 32;  // tokens whose V rows stay in L1 across heads and head_dim chunks
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t t1 = std::min(n, t0 + kTile);
    for (int64_t t = t0 + kTile; t < std::min(n, t1 + kTile); ++t) prefetch_token(s, g, v, heads, t);
    for (int64_t h = 0; h < heads; ++h) {
      const T* vh = v + h * g.kv_head_stride;
      for (int64_t c = 0; c < g.head_dim; c += kLanes) {
        float* acc = s.acc.data() + h * ROWS * g.head_dim + c;
        const float* p = s.scores.data() + h * ROWS * stride;
        f32x16 a[ROWS];
        for (int r = 0; r < ROWS; ++r) a[r] = load16(acc + r * g.head_dim);
        for (int64_t t = t0; t < t1; ++t) {
          const f32x16 vc = load16(vh + s.offsets[t] + c);
          for (int r = 0; r < ROWS; ++r) a[r] += p[r * stride + t] * vc;
        }
        for (int r = 0; r < ROWS; ++r) store16(acc + r * g.head_dim, a[r]);
      }
    }
  }
}

// Fills s.acc (unnormalised) and s.row_sum; row r of every head sees row_len[r] of the first n keys.
template <typename T, int ROWS>
void attend_few_rows(Scratch& s, const Geometry& g, const T* k, const T* v, int64_t heads, int64_t n,
                     const int64_t* row_len) {
  const int64_t stride = (n + kLanes - 1) / kLanes * kLanes;
  if (static_cast<int64_t>(s.scores.size()) < heads * ROWS * stride) s.scores.resize(heads * ROWS * stride);
  few_scores<T, ROWS>(s, g, k, heads, n, stride);
  for (int64_t r = 0; r < heads * ROWS; ++r)
    s.row_sum[r] = exact_softmax(s.scores.data() + r * stride, row_len[r % ROWS], stride);
  few_values<T, ROWS>(s, g, v, heads, n, stride);
}

template <typename T>
void attend_few(Scratch& s, const Geometry& g, int64_t rows, const T* k, const T* v, int64_t heads, int64_t n,
                const int64_t* row_len) {
  switch (rows) {
    case 1: return attend_few_rows<T, 1>(s, g, k, v, heads, n, row_len);
    case 2: return attend_few_rows<T, 2>(s, g, k, v, heads, n, row_len);
    case 3: return attend_few_rows<T, 3>(s, g, k, v, heads, n, row_len);
    case 4: return attend_few_rows<T, 4>(s, g, k, v, heads, n, row_len);
    case 5: return attend_few_rows<T, 5>(s, g, k, v, heads, n, row_len);
    case 6: return attend_few_rows<T, 6>(s, g, k, v, heads, n, row_len);
    case 7: return attend_few_rows<T, 7>(s, g, k, v, heads, n, row_len);
    default: return attend_few_rows<T, 8>(s, g, k, v, heads, n, row_len);
  }
}
static_assert(kFewRows == 8, "attend_few dispatches 1 .. 8 rows");

// Many rows: widen the block once (K transposed) and run the score loop 16 tokens at a time.
template <typename T>
void block_many_rows(Scratch& s, const Geometry& g, int64_t rows, const T* kb, const T* vb, int64_t nt,
                     const int64_t* visible) {
  const int64_t padded = (g.block_size + kLanes - 1) / kLanes * kLanes;
  const int64_t chunks = g.head_dim / kLanes;
  float* k_t = s.k_t.data();
  float* vf = s.v.data();
  for (int64_t t = 0; t < nt; ++t) {
    const T* kr = kb + t * g.kv_tok_stride;
    const T* vr = vb + t * g.kv_tok_stride;
    for (int64_t d = 0; d < g.head_dim; ++d) k_t[d * padded + t] = widen(kr[d]);
    for (int64_t c = 0; c < chunks; ++c) {
      const f32x16 x = load16(vr + c * kLanes);
      std::memcpy(vf + t * g.head_dim + c * kLanes, &x, sizeof x);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = visible[r];
    if (n <= 0) continue;
    float* sc = s.scores.data() + r * padded;
    const float* qr = s.q.data() + r * g.head_dim;
    // Lanes past n compute garbage that nobody reads. Four independent sums hide the FMA latency.
    int64_t t = 0;
    for (; t + 4 * kLanes <= padded && t < n; t += 4 * kLanes) {
      f32x16 d0{}, d1{}, d2{}, d3{};
      for (int64_t d = 0; d < g.head_dim; ++d) {
        const float* kd = k_t + d * padded + t;
        d0 += qr[d] * load16(kd);
        d1 += qr[d] * load16(kd + kLanes);
        d2 += qr[d] * load16(kd + 2 * kLanes);
        d3 += qr[d] * load16(kd + 3 * kLanes);
      }
      std::memcpy(sc + t, &d0, sizeof d0);
      std::memcpy(sc + t + kLanes, &d1, sizeof d1);
      std::memcpy(sc + t + 2 * kLanes, &d2, sizeof d2);
      std::memcpy(sc + t + 3 * kLanes, &d3, sizeof d3);
    }
    for (; t < n; t += kLanes) {
      f32x16 dot{};
      for (int64_t d = 0; d < g.head_dim; ++d) dot += qr[d] * load16(k_t + d * padded + t);
      std::memcpy(sc + t, &dot, sizeof dot);
    }
    float* acc = s.acc.data() + r * g.head_dim;
    softmax_step(sc, n, s.row_max[r], s.row_sum[r], acc, g.head_dim);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* vc = vf + c * kLanes;
      f32x16 a0 = load16(acc + c * kLanes), a1{}, a2{}, a3{};
      int64_t u = 0;
      for (; u + 4 <= n; u += 4) {
        a0 += sc[u] * load16(vc + u * g.head_dim);
        a1 += sc[u + 1] * load16(vc + (u + 1) * g.head_dim);
        a2 += sc[u + 2] * load16(vc + (u + 2) * g.head_dim);
        a3 += sc[u + 3] * load16(vc + (u + 3) * g.head_dim);
      }
      for (; u < n; ++u) a0 += sc[u] * load16(vc + u * g.head_dim);
      const f32x16 a = (a0 + a1) + (a2 + a3);
      std::memcpy(acc + c * kLanes, &a, sizeof a);
    }
  }
}

#if defined(__AVX512BF16__)
// Many rows over a bf16 cache with native bf16 dot products (vdpbf16ps: 32 multiply-adds of bf16
// pairs into fp32 lanes per instruction, twice the fp32 FMA rate). K and V stay bf16, laid out in
// the pairs the instruction takes: K as [head_dim / 2][tokens][2], V as [tokens / 2][head_dim][2].
// The query is the model's own bf16 value (the scale is applied to the fp32 scores); the softmax
// weights are rounded to bf16 for the PV product, as flash attention does in bf16.
void block_many_rows_bf16(Scratch& s, const Geometry& g, int64_t rows, const c10::BFloat16* kb,
                          const c10::BFloat16* vb, int64_t nt, const int64_t* visible) {
  const int64_t padded = (g.block_size + kLanes - 1) / kLanes * kLanes;
  const int64_t half_d = g.head_dim / 2;
  uint16_t* kp = s.k_pairs.data();
  uint16_t* vp = s.v_pairs.data();
  for (int64_t t = 0; t < nt; ++t) {
    const uint16_t* kr = reinterpret_cast<const uint16_t*>(kb + t * g.kv_tok_stride);
    const uint16_t* vr = reinterpret_cast<const uint16_t*>(vb + t * g.kv_tok_stride);
    uint16_t* vo = vp + (t >> 1) * g.head_dim * 2 + (t & 1);
    for (int64_t d = 0; d < g.head_dim; ++d) {
      kp[(d >> 1) * padded * 2 + t * 2 + (d & 1)] = kr[d];
      vo[d * 2] = vr[d];
    }
  }
  for (int64_t t = nt; t < padded; ++t)  // finite lanes past the block's tokens
    for (int64_t d = 0; d < g.head_dim; ++d) kp[(d >> 1) * padded * 2 + t * 2 + (d & 1)] = 0;
  if (nt & 1)
    for (int64_t d = 0; d < g.head_dim; ++d) vp[(nt >> 1) * g.head_dim * 2 + d * 2 + 1] = 0;

  const __m512 scale = _mm512_set1_ps(g.scale);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = visible[r];
    if (n <= 0) continue;
    float* sc = s.scores.data() + r * padded;
    const uint16_t* qr = s.q_bf16.data() + r * g.head_dim;
    for (int64_t t = 0; t < n; t += kLanes) {
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      const uint16_t* kt = kp + t * 2;
      int64_t dp = 0;
      for (; dp + 2 <= half_d; dp += 2) {  // two independent sums hide the latency
        uint32_t q0, q1;
        std::memcpy(&q0, qr + dp * 2, 4);
        std::memcpy(&q1, qr + dp * 2 + 2, 4);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(q0), (__m512bh)_mm512_loadu_si512(kt + dp * padded * 2));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32(q1),
                              (__m512bh)_mm512_loadu_si512(kt + (dp + 1) * padded * 2));
      }
      for (; dp < half_d; ++dp) {
        uint32_t q0;
        std::memcpy(&q0, qr + dp * 2, 4);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(q0), (__m512bh)_mm512_loadu_si512(kt + dp * padded * 2));
      }
      _mm512_storeu_ps(sc + t, _mm512_mul_ps(_mm512_add_ps(a0, a1), scale));
    }
    float* acc = s.acc.data() + r * g.head_dim;
    softmax_step(sc, n, s.row_max[r], s.row_sum[r], acc, g.head_dim);
    if (n & 1) sc[n] = 0.f;  // the odd token's partner in the last pair
    const int64_t pairs = (n + 1) / 2;
    uint16_t* pb = s.p_bf16.data();
    for (int64_t t = 0; t < 2 * pairs; t += kLanes) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(sc + t));
      std::memcpy(pb + t, &h, sizeof h);
    }
    for (int64_t c = 0; c < g.head_dim; c += kLanes) {
      __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_setzero_ps();
      const uint16_t* vc = vp + c * 2;
      int64_t tp = 0;
      for (; tp + 2 <= pairs; tp += 2) {
        uint32_t p0, p1;
        std::memcpy(&p0, pb + tp * 2, 4);
        std::memcpy(&p1, pb + tp * 2 + 2, 4);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(p0),
                              (__m512bh)_mm512_loadu_si512(vc + tp * g.head_dim * 2));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32(p1),
                              (__m512bh)_mm512_loadu_si512(vc + (tp + 1) * g.head_dim * 2));
      }
      if (tp < pairs) {
        uint32_t p0;
        std::memcpy(&p0, pb + tp * 2, 4);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(p0),
                              (__m512bh)_mm512_loadu_si512(vc + tp * g.head_dim * 2));
      }
      _mm512_storeu_ps(acc + c, _mm512_add_ps(a0, a1));
    }
  }
}
#endif

template <typename T>
void attend(const WorkItem& w, const Geometry& g, const T* q, const T* k_cache, const T* v_cache,
            const int32_t* block_table, int64_t context_len, int64_t seq_queries, int64_t query_start, T* out,
            Scratch& s) {
  const int64_t per_head = w.num_queries * g.group;  // rows of one KV head
  const int64_t rows = per_head * w.num_kv_heads;
  s.fit(rows, g.head_dim, g.block_size);
  const int64_t first_pos = context_len - seq_queries + w.first_query;  // position of the tile's first query
  const int64_t kv_end = first_pos + w.num_queries;                     // keys the tile's last query sees
  // Row r: query token r % per_head / group of query head (kv_head + r / per_head) * group + r % group.
  const auto row_token = [&](int64_t r) { return query_start + w.first_query + r % per_head / g.group; };
  const auto row_head = [&](int64_t r) { return (w.kv_head + r / per_head) * g.group + r % g.group; };

  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + row_token(r) * g.q_tok_stride + row_head(r) * g.q_head_stride;
    float* dst = s.q.data() + r * g.head_dim;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = widen(src[d]) * g.scale;
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      std::memcpy(s.q_bf16.data() + r * g.head_dim, src, g.head_dim * sizeof(T));
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.row_max.begin(), s.row_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.end(), 0.f);

  std::vector<int64_t> visible(rows);
  if (per_head <= kFewRows) {
    for (int64_t r = 0; r < per_head; ++r) visible[r] = first_pos + r / g.group + 1;
    token_offsets(s, g, block_table, w.kv_head, kv_end);
    attend_few<T>(s, g, per_head, k_cache, v_cache, w.num_kv_heads, kv_end, visible.data());
  } else {
    for (int64_t j = 0; j * g.block_size < kv_end; ++j) {
      const int64_t t0 = j * g.block_size;
      const int64_t nt = std::min(g.block_size, kv_end - t0);
      for (int64_t r = 0; r < rows; ++r)  // causal: a row sees keys up to its own position
        visible[r] = std::min(nt, first_pos + r / g.group - t0 + 1);
      const int64_t base = static_cast<int64_t>(block_table[j]) * g.kv_block_stride + w.kv_head * g.kv_head_stride;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        block_many_rows_bf16(s, g, rows, k_cache + base, v_cache + base, nt, visible.data());
        continue;
      }
#endif
      block_many_rows<T>(s, g, rows, k_cache + base, v_cache + base, nt, visible.data());
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + row_token(r) * g.out_tok_stride + row_head(r) * g.head_dim;
    const float inv = 1.f / s.row_sum[r];
    const float* acc = s.acc.data() + r * g.head_dim;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  }
}

void check_cache(const at::Tensor& cache, const at::Tensor& like, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(cache.stride(3) == 1, name, "'s head_dim must be contiguous");
  TORCH_CHECK(cache.scalar_type() == like.scalar_type(), name, " dtype differs from the queries'");
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace

// out[T, heads, head_dim] = attention of q[T, heads, head_dim] over the paged cache.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out must be a contiguous tensor shaped and typed like q");
  check_cache(key_cache, q, "key_cache");
  check_cache(value_cache, q, "value_cache");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must share one layout");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt,
              "seq_lens and query_start_loc: int32");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "one row per sequence");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = key_cache.size(2), block_size = key_cache.size(1);
  TORCH_CHECK(key_cache.size(3) == head_dim && heads % kv_heads == 0, "head counts or head_dim do not match");
  TORCH_CHECK(head_dim % kLanes == 0 && head_dim <= 256, "head_dim must be a multiple of 16, at most 256");
  const Geometry g{q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                   heads / kv_heads, head_dim, block_size, heads * head_dim, static_cast<float>(scale)};
  const int64_t queries_per_tile = std::max<int64_t>(1, kRowsPerTile / g.group);

  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  std::vector<WorkItem> work;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = starts[s + 1] - starts[s];
    TORCH_CHECK(n >= 0 && n <= lens[s], "sequence ", s, " has more queries than context");
    TORCH_CHECK((lens[s] + block_size - 1) / block_size <= max_blocks, "sequence ", s, "'s block table is short");
    if (n * g.group <= kFewRows && num_seqs >= 4 * at::get_num_threads()) {  // enough items without splitting heads
      work.push_back({static_cast<int32_t>(s), 0, static_cast<int32_t>(kv_heads), 0, static_cast<int32_t>(n)});
      continue;
    }
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = 0; i < n; i += queries_per_tile)
        work.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), 1, static_cast<int32_t>(i),
                        static_cast<int32_t>(std::min(queries_per_tile, n - i))});
  }
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = key_cache.data_ptr<scalar_t>();
    const scalar_t* vp = value_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t i = begin; i < end; ++i) {
        const WorkItem& w = work[i];
        attend<scalar_t>(w, g, qp, kp, vp, tables + w.seq * max_blocks, lens[w.seq], starts[w.seq + 1] - starts[w.seq],
                         starts[w.seq], op, scratch);
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: return run(float{});
    case at::kBFloat16: return run(c10::BFloat16{});
    case at::kHalf: return run(c10::Half{});
    default: TORCH_CHECK(false, "paged_attention takes float32, bfloat16 or float16, not ", q.scalar_type());
  }
}

// key_cache/value_cache[slot // block_size, slot % block_size] = key/value, for each token.
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slots) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && key.stride(1) == key.size(2), "key: [tokens, kv_heads, d]");
  TORCH_CHECK(value.sizes() == key.sizes() && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "value: [tokens, kv_heads, d]");
  check_cache(key_cache, key, "key_cache");
  check_cache(value_cache, value, "value_cache");
  TORCH_CHECK(key_cache.stride(2) == key.size(2) && key_cache.size(2) == key.size(1),
              "a cache token's heads must be contiguous and match key's");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.size(0) == key.size(0), "slots: int64, one per token");
  const int64_t tokens = key.size(0), es = key.element_size();
  const int64_t bytes = es * key.size(1) * key.size(2);
  const int64_t block_size = key_cache.size(1), num_slots = key_cache.size(0) * block_size;
  const int64_t* sl = slots.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "slot ", sl[t], " is outside the cache");
    const int64_t at = (sl[t] / block_size) * key_cache.stride(0) + (sl[t] % block_size) * key_cache.stride(1);
    std::memcpy(kc + at * es, kp + t * key.stride(0) * es, bytes);
    std::memcpy(vc + at * es, vp + t * value.stride(0) * es, bytes);
  }
}

TORCH_LIBRARY(pdserve_kernels, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}
