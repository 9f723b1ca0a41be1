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

// The cache offset of each key first .. end - 1 (first: a sliding window's start, or 0; stored from index 0) of
// the first head, and of its scales over 8-bit codes: no division in the token loops.
inline void token_offsets(Scratch& s, const Geometry& g, const int32_t* block_table, int64_t kv_head, int64_t first,
                          int64_t end, bool scales) {
  const int64_t n = end - first;
  s.offsets.resize(n);
  s.scale_offsets.resize(scales ? n : 0);
  for (int64_t j = first / g.block_size, t0 = j * g.block_size; t0 < end; t0 += g.block_size, ++j) {
    const int64_t block = block_table[j];
    const int64_t base = block * g.kv_block_stride + kv_head * g.kv_head_stride;
    const int64_t lo = std::max(first, t0), hi = std::min(end, t0 + g.block_size);
    for (int64_t t = lo; t < hi; ++t) s.offsets[t - first] = base + (t - t0) * g.kv_tok_stride;
    if (!scales) continue;
    const int64_t sbase = block * g.sc_block_stride + kv_head * g.sc_head_stride;
    for (int64_t t = lo; t < hi; ++t) s.scale_offsets[t - first] = sbase + (t - t0) * g.sc_tok_stride;
  }
}

// 8-bit codes: each token's K and V scales (times the code's unit), [head][token] as floats, so that the
// scores and the softmax weights take them once per row and token (the loops over head_dim never do).
template <typename C>
void gather_scales(Scratch& s, const Geometry& g, const KVRefs<C>& kv, int64_t heads, int64_t n) {
  const float k_unit = s.codes_on_bf16 ? 1.f : code_unit<C>();  // the bf16 dot products take their own units
  const float v_unit = s.codes_on_bf16 ? kPartnerUnit<C> : code_unit<C>();
  // a block's scales are a few lines apart from its codes: ask for all of them first (many misses in flight)
  for (int64_t t = 0; t < n; t += g.block_size)
    for (const c10::BFloat16* base : {kv.k_scale, kv.v_scale}) {
      const char* p = reinterpret_cast<const char*>(base + s.scale_offsets[t]);
      const int64_t bytes = std::min(g.block_size, n - t) * g.sc_tok_stride * 2;
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
    }
  s.kscale.resize(heads * n);
  s.vscale.resize(heads * n);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = s.scale_offsets[t] + h * g.sc_head_stride;
      s.kscale[h * n + t] = widen(kv.k_scale[at]) * k_unit;
      s.vscale[h * n + t] = widen(kv.v_scale[at]) * v_unit;
    }
}

// Rows (h * rows_per_head + r) of sc: sc[row][t] *= scale[h][t] for t < n.
inline void scale_rows(float* sc, int64_t rows_per_head, int64_t heads, int64_t n, int64_t stride,
                       const float* scale) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < rows_per_head; ++r) {
      float* row = sc + (h * rows_per_head + r) * stride;
      const float* f = scale + h * n;
      int64_t t = 0;
      for (; t + kLanes <= n; t += kLanes) vstore(row + t, vload(row + t) * vload(f + t));
      for (; t < n; ++t) row[t] *= f[t];
    }
}

// The cache lies in DRAM during a decode step (each layer's K/V is read once per step) and a sequence's
// blocks are scattered: ask for token t's rows of all `heads` a little ahead of their use.
template <typename T, int kLocality = 3>
inline void prefetch_token(const Scratch& s, const Geometry& g, const T* cache, int64_t heads, int64_t t) {
  const char* p = reinterpret_cast<const char*>(cache + s.offsets[t]);
  const int64_t bytes = ((heads - 1) * g.kv_head_stride + g.head_dim) * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, kLocality);
}

// Head h's dot products of token t with its ROWS queries, one vector of partial sums per row.
template <typename T, int ROWS>
inline void dot_rows(const Scratch& s, const Geometry& g, const T* kr, int64_t h, fvec* d) {
  const float* q = s.q.data() + h * ROWS * g.head_dim;
  for (int64_t c = 0; c < g.head_dim / kLanes; ++c) {
    const fvec kc = vload_units(kr + c * kLanes);
    for (int r = 0; r < ROWS; ++r) d[r] += vload(q + r * g.head_dim + c * kLanes) * kc;
  }
}

#if defined(__AVX512BF16__)
// The same with native bf16 dot products on the query in s.q_bf16 (the scale comes after): K as it lies in a bf16
// cache, or 8-bit codes as bf16 patterns (codes_as_bf16, kv_codes.h; the query then carries kPartnerUnit and the
// sums kSumUnit).
template <typename C, int ROWS>
inline void dot_rows_bf16(const Scratch& s, const Geometry& g, const C* kr, int64_t h, fvec* d) {
  const uint16_t* q = s.q_bf16.data() + h * ROWS * g.head_dim;
  __m512 a[ROWS];
  for (int r = 0; r < ROWS; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < g.head_dim; c += 32) {
    __m512bh kc;
    if constexpr (is_code<C>())
      kc = (__m512bh)codes_as_bf16(kr + c);
    else
      kc = (__m512bh)_mm512_loadu_si512(kr + c);
    for (int r = 0; r < ROWS; ++r)
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(q + r * g.head_dim + c), kc);
  }
  const float unit = is_code<C>() ? g.scale * kSumUnit<C> : g.scale;
  for (int r = 0; r < ROWS; ++r) d[r] = (fvec)a[r] * unit;
}
#endif


template <typename T, int ROWS>
void few_scores(Scratch& s, const Geometry& g, const T* k, const T* v, int64_t heads, int64_t n, int64_t stride) {
  const int64_t rows = heads * ROWS;
  s.dots.resize(rows * kLanes);
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    for (int64_t i = 0; i < kLanes; ++i) {
      if (t0 + i + 2 * kLanes < n) prefetch_token(s, g, k, heads, t0 + i + 2 * kLanes);
      // an 8-bit sequence's V rows fit in L2 (1,024 tokens x 3 heads: 192 KiB): ask for them with its K, so
      // the V pass reads from L2 instead of waiting on DRAM token by token
      if constexpr (is_code<T>())
        if (t0 + i + 2 * kLanes < n) prefetch_token<T, 2>(s, g, v, heads, t0 + i + 2 * kLanes);
      for (int64_t h = 0; h < heads; ++h) {
        fvec d[ROWS] = {};
        if (t0 + i < n) {
          const T* kr = k + s.offsets[t0 + i] + h * g.kv_head_stride;
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (g.head_dim % 32 == 0)
              dot_rows_bf16<T, ROWS>(s, g, kr, h, d);
            else
              dot_rows<T, ROWS>(s, g, kr, h, d);
          } else if constexpr (is_code<T>()) {
            if (s.codes_on_bf16)
              dot_rows_bf16<T, ROWS>(s, g, kr, h, d);
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
        fvec a[ROWS];
        for (int r = 0; r < ROWS; ++r) a[r] = vload(acc + r * g.head_dim);
        for (int64_t t = t0; t < t1; ++t) {
          const fvec vc = vload_units(vh + s.offsets[t] + c);
          for (int r = 0; r < ROWS; ++r) a[r] += p[r * stride + t] * vc;
        }
        for (int r = 0; r < ROWS; ++r) vstore(acc + r * g.head_dim, a[r]);
      }
    }
  }
}

#if defined(__AVX512BF16__)
// few_values over 8-bit codes on native bf16 dot products, two tokens at a time: the weights (scores times each
// token's V scale and kPartnerUnit) as bf16 pairs, the two tokens' codes as bf16 interleaved by 16-bit words. The
// interleave works within 128-bit lanes, so a 32-dimension half's accumulators hold dimensions 8L..8L+3 (first
// register) and 8L+4..8L+7 (second) at lanes 4L..4L+3; they are put back in order, times kSumUnit, at the end.
// The weights are rounded to bf16, as flash attention does in bf16.
template <typename C, int ROWS>
void few_values_codes_bf16(Scratch& s, const Geometry& g, const C* v, int64_t heads, int64_t n, int64_t stride) {
  constexpr int64_t kTile = 32;
  const int64_t rows = heads * ROWS, pair_stride = (stride + 31) / 32 * 16;
  s.pp.resize(rows * pair_stride);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < stride; t += 32) {
      const float* p = s.scores.data() + r * stride + t;
      const __m512 lo = _mm512_loadu_ps(p), hi = t + 16 < stride ? _mm512_loadu_ps(p + 16) : _mm512_setzero_ps();
      _mm512_storeu_si512(s.pp.data() + r * pair_stride + t / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t t1 = std::min(n, t0 + kTile);
    for (int64_t t = t0 + kTile; t < std::min(n, t1 + kTile); ++t) prefetch_token(s, g, v, heads, t);
    for (int64_t h = 0; h < heads; ++h) {
      const C* vh = v + h * g.kv_head_stride;
      const uint32_t* pp = s.pp.data() + h * ROWS * pair_stride;
      for (int64_t c = 0; c < g.head_dim; c += 32) {
        float* acc = s.acc.data() + h * ROWS * g.head_dim + c;
        __m512 a[ROWS][2];
        for (int r = 0; r < ROWS; ++r) {
          a[r][0] = _mm512_loadu_ps(acc + r * g.head_dim);
          a[r][1] = _mm512_loadu_ps(acc + r * g.head_dim + 16);
        }
        for (int64_t t = t0; t < t1; t += 2) {
          const __m512i x = codes_as_bf16(vh + s.offsets[t] + c);
          const __m512i y = t + 1 < n ? codes_as_bf16(vh + s.offsets[t + 1] + c) : _mm512_setzero_si512();
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
          for (int r = 0; r < ROWS; ++r) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * pair_stride + t / 2]));
            a[r][0] = _mm512_dpbf16_ps(a[r][0], w, lo);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], w, hi);
          }
        }
        for (int r = 0; r < ROWS; ++r) {
          _mm512_storeu_ps(acc + r * g.head_dim, a[r][0]);
          _mm512_storeu_ps(acc + r * g.head_dim + 16, a[r][1]);
        }
      }
    }
  }
  float ordered[32];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < g.head_dim; c += 32) {
      float* acc = s.acc.data() + r * g.head_dim + c;
      for (int j = 0; j < 16; ++j) {
        ordered[8 * (j / 4) + j % 4] = acc[j];
        ordered[8 * (j / 4) + 4 + j % 4] = acc[16 + j];
      }
      for (int d = 0; d < 32; ++d) acc[d] = ordered[d] * kSumUnit<C>;
    }
}
#endif

// Fills s.acc (unnormalised) and s.row_sum; row r of every head sees keys row_first[r] .. row_len[r] - 1 of
// the n keys.
template <typename C, int ROWS>
void attend_few_rows(Scratch& s, const Geometry& g, const KVRefs<C>& kv, int64_t heads, int64_t n,
                     const int64_t* row_len, const int64_t* row_first) {
  const int64_t stride = (n + kLanes - 1) / kLanes * kLanes;
  if (static_cast<int64_t>(s.scores.size()) < heads * ROWS * stride) s.scores.resize(heads * ROWS * stride);
  if constexpr (is_code<C>()) gather_scales(s, g, kv, heads, n);
  few_scores<C, ROWS>(s, g, kv.k, kv.v, heads, n, stride);
  if constexpr (is_code<C>()) scale_rows(s.scores.data(), ROWS, heads, n, stride, s.kscale.data());
  for (int64_t r = 0; r < heads * ROWS; ++r)  // a window's rows: the keys before their own window weigh nothing
    std::fill(s.scores.data() + r * stride, s.scores.data() + r * stride + row_first[r % ROWS],
              -std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < heads * ROWS; ++r)
    s.row_sum[r] = exact_softmax(s.scores.data() + r * stride, row_len[r % ROWS], stride);
  // the weights of a token's V codes take its V scale: sum_t p_t s_t v_t
  if constexpr (is_code<C>()) scale_rows(s.scores.data(), ROWS, heads, n, stride, s.vscale.data());
#if defined(__AVX512BF16__)
  if constexpr (is_code<C>()) {
    if (s.codes_on_bf16) return few_values_codes_bf16<C, ROWS>(s, g, kv.v, heads, n, stride);
  }
#endif
  few_values<C, ROWS>(s, g, kv.v, heads, n, stride);
}

template <typename C>
void attend_few(Scratch& s, const Geometry& g, int64_t rows, const KVRefs<C>& kv, int64_t heads, int64_t n,
                const int64_t* row_len, const int64_t* row_first) {
  switch (rows) {
    case 1: return attend_few_rows<C, 1>(s, g, kv, heads, n, row_len, row_first);
    case 2: return attend_few_rows<C, 2>(s, g, kv, heads, n, row_len, row_first);
    case 3: return attend_few_rows<C, 3>(s, g, kv, heads, n, row_len, row_first);
    case 4: return attend_few_rows<C, 4>(s, g, kv, heads, n, row_len, row_first);
    case 5: return attend_few_rows<C, 5>(s, g, kv, heads, n, row_len, row_first);
    case 6: return attend_few_rows<C, 6>(s, g, kv, heads, n, row_len, row_first);
    case 7: return attend_few_rows<C, 7>(s, g, kv, heads, n, row_len, row_first);
    default: return attend_few_rows<C, 8>(s, g, kv, heads, n, row_len, row_first);
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
#if defined(__AVX512BF16__)
  s.codes_on_bf16 = std::is_same_v<T, c10::BFloat16> && is_code<C>() && g.head_dim % 32 == 0;
#endif
  s.acc.assign(rows * g.head_dim, 0.f);
  s.row_sum.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + row_token(r) * g.q_tok_stride + row_head(r) * g.q_head_stride;
    float* dst = s.q.data() + r * g.head_dim;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = widen(src[d]) * g.scale;
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>)
      std::memcpy(s.q_bf16.data() + r * g.head_dim, src, g.head_dim * sizeof(T));
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16> && is_code<C>())  // exact: a power of two
      for (int64_t d = 0; d < g.head_dim; ++d) s.q_bf16[r * g.head_dim + d] = c10::BFloat16(widen(src[d]) * kPartnerUnit<C>).x;
#endif
  }
  // With a window, the keys before the first row's window are not read at all; each row masks the rest of its own.
  const int64_t first_key = g.window ? std::max<int64_t>(0, first_pos - g.window + 1) : 0;
  int64_t visible[kFewRows], row_first[kFewRows];
  for (int64_t r = 0; r < per_head; ++r) {
    const int64_t pos = first_pos + r / g.group;
    visible[r] = pos + 1 - first_key;
    row_first[r] = g.window ? std::max<int64_t>(0, pos - g.window + 1) - first_key : 0;
  }
  token_offsets(s, g, block_table, w.kv_head, first_key, kv_end, is_code<C>());
  attend_few<C>(s, g, per_head, kv, w.num_kv_heads, kv_end - first_key, visible, row_first);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + row_token(r) * g.out_tok_stride + row_head(r) * g.head_dim;
    const float inv = 1.f / s.row_sum[r];
    const float* acc = s.acc.data() + r * g.head_dim;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  }
}

}  // namespace pdserve
