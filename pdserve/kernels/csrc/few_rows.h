// The few-rows path of paged attention: a decode token's query heads, or a short chunk's (at most
// kFewRows rows per KV head), for one or all KV heads of a sequence.
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "attention_common.h"
#include "kv_codes.h"
#include "vec.h"

namespace pdserve {

// Few rows (a decode token's query heads, or a short chunk's), for `heads` KV heads side by side: every
// score of the context first, then one exact softmax per row, then the weighted sum of V with the
// accumulators in registers. K is read once for all rows of a head, kLanes tokens' dot products are summed
// by one transpose tree, and all heads of a token are read together: a block's rows are adjacent in the
// cache, so one work item streams each block front to back, which the hardware prefetcher follows
// (reading one head's 128-byte slices of a scattered block ran at a third of the bandwidth).
// Row (h * ROWS + r) is head h's row r in s.q, s.scores, s.acc and s.row_sum.

// The cache offset of each of the first n tokens (first head), and of its scales over 8-bit codes: no
// division in the token loops.
inline void token_offsets(Scratch& s, const Geometry& g, const int32_t* block_table, int64_t kv_head, int64_t n,
                          bool scales) {
  s.offsets.resize(n);
  s.scale_offsets.resize(scales ? n : 0);
  for (int64_t t0 = 0, j = 0; t0 < n; t0 += g.block_size, ++j) {
    const int64_t block = block_table[j];
    const int64_t base = block * g.kv_block_stride + kv_head * g.kv_head_stride;
    for (int64_t t = t0; t < std::min(n, t0 + g.block_size); ++t) s.offsets[t] = base + (t - t0) * g.kv_tok_stride;
    if (!scales) continue;
    const int64_t sbase = block * g.sc_block_stride + kv_head * g.sc_head_stride;
    for (int64_t t = t0; t < std::min(n, t0 + g.block_size); ++t)
      s.scale_offsets[t] = sbase + (t - t0) * g.sc_tok_stride;
  }
}

// Head h's scale of token t (8-bit codes), or 1.
template <typename C>
inline float token_scale(const Scratch& s, const Geometry& g, const c10::BFloat16* scales, int64_t h, int64_t t) {
  if constexpr (is_code<C>()) return widen(scales[s.scale_offsets[t] + h * g.sc_head_stride]);
  return 1.f;
}

// The cache lies in DRAM during a decode step (each layer's K/V is read once per step) and a sequence's
// blocks are scattered: ask for token t's rows of all `heads` a little ahead of their use.
template <typename T>
inline void prefetch_token(const Scratch& s, const Geometry& g, const T* cache, int64_t heads, int64_t t) {
  const char* p = reinterpret_cast<const char*>(cache + s.offsets[t]);
  const int64_t bytes = ((heads - 1) * g.kv_head_stride + g.head_dim) * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// Head h's dot products of token t with its ROWS queries, one vector of partial sums per row.
template <typename T, int ROWS>
inline void dot_rows(const Scratch& s, const Geometry& g, const T* kr, int64_t h, fvec* d) {
  const float* q = s.q.data() + h * ROWS * g.head_dim;
  for (int64_t c = 0; c < g.head_dim / kLanes; ++c) {
    const fvec kc = vload(kr + c * kLanes);
    for (int r = 0; r < ROWS; ++r) d[r] += vload(q + r * g.head_dim + c * kLanes) * kc;
  }
}

#if defined(__AVX512BF16__)
// The same with native bf16 dot products on the model's own bf16 query (the scale comes after).
template <int ROWS>
inline void dot_rows_bf16(const Scratch& s, const Geometry& g, const c10::BFloat16* kr, int64_t h, fvec* d) {
  const uint16_t* q = s.q_bf16.data() + h * ROWS * g.head_dim;
  __m512 a[ROWS];
  for (int r = 0; r < ROWS; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < g.head_dim; c += 32) {
    const __m512bh kc = (__m512bh)_mm512_loadu_si512(kr + c);
    for (int r = 0; r < ROWS; ++r)
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(q + r * g.head_dim + c), kc);
  }
  for (int r = 0; r < ROWS; ++r) d[r] = (fvec)a[r] * g.scale;
}
#endif

template <typename T, int ROWS>
void few_scores(Scratch& s, const Geometry& g, const T* k, const c10::BFloat16* k_scale, int64_t heads, int64_t n,
                int64_t stride) {
  const int64_t rows = heads * ROWS;
  s.dots.resize(rows * kLanes);
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    for (int64_t i = 0; i < kLanes; ++i) {
      if (t0 + i + kLanes < n) prefetch_token(s, g, k, heads, t0 + i + kLanes);
      for (int64_t h = 0; h < heads; ++h) {
        fvec d[ROWS] = {};
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
          if constexpr (is_code<T>()) {
            const float sk = token_scale<T>(s, g, k_scale, h, t0 + i);
            for (int r = 0; r < ROWS; ++r) d[r] *= sk;
          }
        }
        for (int r = 0; r < ROWS; ++r) s.dots[(h * ROWS + r) * kLanes + i] = d[r];
      }
    }
    for (int64_t r = 0; r < rows; ++r) vstore(s.scores.data() + r * stride + t0, reduce_lanes(&s.dots[r * kLanes]));
  }
}

// sc[0, n) become exp(sc - max) and sc[n, padded) zero; returns their sum.
inline float exact_softmax(float* sc, int64_t n, int64_t padded) {
  fvec mv = splat(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) mv = vmax(mv, vload(sc + t));
  float m = hmax(mv);
  for (; t < n; ++t) m = std::max(m, sc[t]);
  const float sum = exp_sum(sc, n, m);
  std::fill(sc + n, sc + padded, 0.f);
  return sum;
}

template <typename T, int ROWS>
void few_values(Scratch& s, const Geometry& g, const T* v, const c10::BFloat16* v_scale, int64_t heads, int64_t n,
                int64_t stride) {
  constexpr int64_t kTile = 32;  // tokens whose V rows stay in L1 across heads and head_dim chunks
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t t1 = std::min(n, t0 + kTile);
    for (int64_t t = t0 + kTile; t < std::min(n, t1 + kTile); ++t) prefetch_token(s, g, v, heads, t);
    for (int64_t h = 0; h < heads; ++h) {
      const T* vh = v + h * g.kv_head_stride;
      for (int64_t c = 0; c < g.head_dim; c += kLanes) {
        float* acc = s.acc.data() + h * ROWS * g.head_dim + c;
        const float* p = s.scores.data() + h * ROWS * stride;
        fvec a[ROWS];
        for (int r = 0; r < ROWS; ++r) a[r] = vload(acc + r * g.head_dim);
        for (int64_t t = t0; t < t1; ++t) {
          const fvec vc = vload(vh + s.offsets[t] + c) * token_scale<T>(s, g, v_scale, h, t);
          for (int r = 0; r < ROWS; ++r) a[r] += p[r * stride + t] * vc;
        }
        for (int r = 0; r < ROWS; ++r) vstore(acc + r * g.head_dim, a[r]);
      }
    }
  }
}

// Fills s.acc (unnormalised) and s.row_sum; row r of every head sees row_len[r] of the first n keys.
template <typename C, int ROWS>
void attend_few_rows(Scratch& s, const Geometry& g, const KVRefs<C>& kv, int64_t heads, int64_t n,
                     const int64_t* row_len) {
  const int64_t stride = (n + kLanes - 1) / kLanes * kLanes;
  if (static_cast<int64_t>(s.scores.size()) < heads * ROWS * stride) s.scores.resize(heads * ROWS * stride);
  few_scores<C, ROWS>(s, g, kv.k, kv.k_scale, heads, n, stride);
  for (int64_t r = 0; r < heads * ROWS; ++r)
    s.row_sum[r] = exact_softmax(s.scores.data() + r * stride, row_len[r % ROWS], stride);
  few_values<C, ROWS>(s, g, kv.v, kv.v_scale, heads, n, stride);
}

template <typename C>
void attend_few(Scratch& s, const Geometry& g, int64_t rows, const KVRefs<C>& kv, int64_t heads, int64_t n,
                const int64_t* row_len) {
  switch (rows) {
    case 1: return attend_few_rows<C, 1>(s, g, kv, heads, n, row_len);
    case 2: return attend_few_rows<C, 2>(s, g, kv, heads, n, row_len);
    case 3: return attend_few_rows<C, 3>(s, g, kv, heads, n, row_len);
    case 4: return attend_few_rows<C, 4>(s, g, kv, heads, n, row_len);
    case 5: return attend_few_rows<C, 5>(s, g, kv, heads, n, row_len);
    case 6: return attend_few_rows<C, 6>(s, g, kv, heads, n, row_len);
    case 7: return attend_few_rows<C, 7>(s, g, kv, heads, n, row_len);
    default: return attend_few_rows<C, 8>(s, g, kv, heads, n, row_len);
  }
}
static_assert(kFewRows == 8, "attend_few dispatches 1 .. 8 rows");

// out rows of the item: every score of the context, one exact softmax per row, the weighted sum of V.
// T: the queries' and the output's dtype; C: the cache's elements (T, or 8-bit codes).
template <typename T, typename C>
void attend_few_item(const WorkItem& w, const Geometry& g, const T* q, const KVRefs<C>& kv,
                     const int32_t* block_table, int64_t first_pos, int64_t query_start, T* out, Scratch& s) {
  const int64_t per_head = w.num_queries * g.group;  // rows of one KV head
  const int64_t rows = per_head * w.num_kv_heads;
  const int64_t kv_end = first_pos + w.num_queries;  // keys the item's last query sees
  // Row r: query token r % per_head / group of query head (kv_head + r / per_head) * group + r % group.
  const auto row_token = [&](int64_t r) { return query_start + w.first_query + r % per_head / g.group; };
  const auto row_head = [&](int64_t r) { return (w.kv_head + r / per_head) * g.group + r % g.group; };
  s.q.resize(rows * g.head_dim);
  s.q_bf16.resize(rows * g.head_dim);
  s.acc.assign(rows * g.head_dim, 0.f);
  s.row_sum.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + row_token(r) * g.q_tok_stride + row_head(r) * g.q_head_stride;
    float* dst = s.q.data() + r * g.head_dim;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = widen(src[d]) * g.scale;
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>)
      std::memcpy(s.q_bf16.data() + r * g.head_dim, src, g.head_dim * sizeof(T));
  }
  int64_t visible[kFewRows];
  for (int64_t r = 0; r < per_head; ++r) visible[r] = first_pos + r / g.group + 1;
  token_offsets(s, g, block_table, w.kv_head, kv_end, is_code<C>());
  attend_few<C>(s, g, per_head, kv, w.num_kv_heads, kv_end, visible);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + row_token(r) * g.out_tok_stride + row_head(r) * g.head_dim;
    const float inv = 1.f / s.row_sum[r];
    const float* acc = s.acc.data() + r * g.head_dim;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  }
}

}  // namespace pdserve
