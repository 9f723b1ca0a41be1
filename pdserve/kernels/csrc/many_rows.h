// The many-rows path of paged attention (a prefill chunk's tile of query tokens x the query heads of
// one KV head): rows in groups of kLanes (16, or 8 on AVX2), one vector lane per row, flash-attention style over the blocks.
//
// Each group holds its query transposed ([head_dim][kLanes rows]), so every key element is one broadcast
// from the cache straight into a multiply-add: K is never converted or copied, and the online
// softmax's running max and sum are per-lane vectors. Several tokens' scores (or several rows x
// chunks of V's accumulators) are in flight at once: a single dependent chain of multiply-adds ran at a
// third of the unit's throughput. V rows are read in place too, weighted by a broadcast softmax weight.
//
// Over a bf16 cache on a CPU with AVX512_BF16 the same shape runs on native bf16 dot products
// (vdpbf16ps: per fp32 lane, the dot product of two bf16 pairs; twice the fp32 FMA rate): the query
// is transposed into pairs of dimensions, V is interleaved by token pairs once per block, and the
// softmax weights are rounded to bf16 for the PV product, as flash attention does in bf16.
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "attention_common.h"
#include "kv_codes.h"
#include "vec.h"

namespace pdserve {

#if defined(__AVX512BF16__)
static_assert(kLanes == 16, "the native bf16 paths hold 16 rows in one __m512");
#endif

#if defined(__AVX512F__)
constexpr int kTokensInFlight = 8;  // score accumulators: 8 of 32 registers
constexpr int kRowsInFlight = 4;    // PV accumulators: 4 rows x 4 chunks of kLanes dims, 16 of 32 registers
#elif defined(PDSERVE_VEC8)
constexpr int kTokensInFlight = 8;  // AVX2, 8-float vectors: 8 of 16 registers
constexpr int kRowsInFlight = 2;    // 2 x 4 = 8 of 16, beside the V chunks being read
#else
constexpr int kTokensInFlight = 4;  // NEON: a 16-float vector is 4 of its 32 registers (unmeasured)
constexpr int kRowsInFlight = 2;
#endif
constexpr int kChunksInFlight = 4;

template <typename T>
constexpr bool native_bf16() {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16>;
#else
  return false;
#endif
}

// --- scores: sc[t] (kLanes rows) = q . k[t] * scale -------------------------------------------------

template <typename T, int TN>
inline void score_tokens(const float* qf, const T* k, int64_t tok_stride, int64_t head_dim, float* sc) {
  fvec a[TN] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const fvec qv = vload(qf + d * kLanes);
    for (int j = 0; j < TN; ++j) a[j] += qv * widen(k[j * tok_stride + d]);
  }
  for (int j = 0; j < TN; ++j) vstore(sc + j * kLanes, a[j]);
}

#if defined(__AVX512BF16__)
inline __m512bh bcast_pair(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(x));
}

// u32 lane i = a[i] | b[i] << 16: two vectors of 16 bf16 as 16 pairs.
inline __m512i pair_up(__m256i a, __m256i b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <int TN>
inline void score_tokens_bf16(const uint32_t* qp, const uint16_t* k, int64_t tok_stride, int64_t half_d,
                              float scale, float* sc) {
  __m512 a[TN];
  for (int j = 0; j < TN; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < half_d; ++dp) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + dp * kLanes);
    for (int j = 0; j < TN; ++j) a[j] = _mm512_dpbf16_ps(a[j], qv, bcast_pair(k + j * tok_stride + 2 * dp));
  }
  for (int j = 0; j < TN; ++j) _mm512_storeu_ps(sc + j * kLanes, _mm512_mul_ps(a[j], _mm512_set1_ps(scale)));
}
#endif

template <typename T>
void group_scores(Scratch& s, const Geometry& g, int64_t group_index, const T* kb, int64_t n) {
  float* sc = s.scores.data();
  int64_t t = 0;
#if defined(__AVX512BF16__)
  if constexpr (native_bf16<T>()) {
    const int64_t half_d = g.head_dim / 2;
    const uint32_t* qp = s.qp.data() + group_index * half_d * kLanes;
    const uint16_t* k = reinterpret_cast<const uint16_t*>(kb);
    for (; t + kTokensInFlight <= n; t += kTokensInFlight)
      score_tokens_bf16<kTokensInFlight>(qp, k + t * g.kv_tok_stride, g.kv_tok_stride, half_d, g.scale, sc + t * kLanes);
    for (; t < n; ++t) score_tokens_bf16<1>(qp, k + t * g.kv_tok_stride, g.kv_tok_stride, half_d, g.scale, sc + t * kLanes);
    return;
  }
#endif
  const float* qf = s.q.data() + group_index * g.head_dim * kLanes;  // already scaled
  for (; t + kTokensInFlight <= n; t += kTokensInFlight)
    score_tokens<T, kTokensInFlight>(qf, kb + t * g.kv_tok_stride, g.kv_tok_stride, g.head_dim, sc + t * kLanes);
  for (; t < n; ++t) score_tokens<T, 1>(qf, kb + t * g.kv_tok_stride, g.kv_tok_stride, g.head_dim, sc + t * kLanes);
}

// --- online softmax over one block, kLanes rows at once ----------------------------------------------

// sc[t] (t < n) become exp(sc - new max), zero where a lane's row sits before token t (t >= visible) or, in a
// sliding window, token t lies before the row's window (t < lowest); the group's running max m and sum l are
// updated. Returns alpha, the factor for the old accumulators.
inline fvec group_softmax(float* sc, int64_t n, ivec visible, bool masked, ivec lowest, bool below, float* m,
                          float* l) {
  const fvec minus_inf = splat(-std::numeric_limits<float>::infinity());
  const fvec m_old = vload(m);
  fvec mx = m_old;
  for (int64_t t = 0; t < n; ++t) {
    fvec x = vload(sc + t * kLanes);
    if (masked || below) {
      const ivec tv = ivec{} + static_cast<int32_t>(t);
      if (masked) x = tv >= visible ? minus_inf : x;
      if (below) x = tv < lowest ? minus_inf : x;
      vstore(sc + t * kLanes, x);
    }
    mx = vmax(mx, x);
  }
  fvec sum{};
  for (int64_t t = 0; t < n; ++t) {  // exp(-inf - mx) is vexp's clamp, 1e-38: below any weight that counts
    const fvec p = vexp(vload(sc + t * kLanes) - mx);
    vstore(sc + t * kLanes, p);
    sum += p;
  }
  const fvec alpha = vexp(m_old - mx);  // m starts at -1e30, not -inf: no inf - inf
  vstore(m, mx);
  vstore(l, vload(l) * alpha + sum);
  return alpha;
}

// --- values: acc = acc * alpha + P V, R rows x C chunks of kLanes dims in registers -----------------

template <typename T, int R, int C>
inline void weigh_values(float* acc, int64_t head_dim, const float* alpha, const float* p, const T* v,
                         int64_t tok_stride, int64_t n) {
  fvec a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = vload(acc + r * head_dim + c * kLanes) * alpha[r];
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < C; ++c) {
      const fvec vv = vload(v + t * tok_stride + c * kLanes);
      for (int r = 0; r < R; ++r) a[r][c] += p[t * kLanes + r] * vv;
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(acc + r * head_dim + c * kLanes, a[r][c]);
}

#if defined(__AVX512BF16__)
template <int R, int C>
inline void weigh_values_bf16(float* acc, int64_t head_dim, const float* alpha, const uint32_t* pp,
                              const uint32_t* vp, int64_t pairs) {
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * head_dim + c * kLanes), _mm512_set1_ps(alpha[r]));
  for (int64_t tp = 0; tp < pairs; ++tp)
    for (int c = 0; c < C; ++c) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + tp * head_dim + c * kLanes);
      for (int r = 0; r < R; ++r)
        a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[tp * kLanes + r])), vv);
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * head_dim + c * kLanes, a[r][c]);
}

// The weights as bf16 token pairs, s.pp[tp][row] (zero past n).
inline void pair_weights(Scratch& s, const float* sc, int64_t n) {
  for (int64_t tp = 0; tp < (n + 1) / 2; ++tp) {
    const __m512 p0 = _mm512_loadu_ps(sc + 2 * tp * kLanes);
    const __m512 p1 = 2 * tp + 1 < n ? _mm512_loadu_ps(sc + (2 * tp + 1) * kLanes) : _mm512_setzero_ps();
    _mm512_storeu_si512(s.pp.data() + tp * kLanes,
                        pair_up((__m256i)_mm512_cvtneps_pbh(p0), (__m256i)_mm512_cvtneps_pbh(p1)));
  }
}

// V of one block as token pairs: s.vp[tp][d] = v[2 tp][d] | v[2 tp + 1][d] << 16 (zero past nt).
inline void pair_values(Scratch& s, const Geometry& g, const c10::BFloat16* vb, int64_t nt) {
  const uint16_t* v = reinterpret_cast<const uint16_t*>(vb);
  for (int64_t tp = 0; tp < (nt + 1) / 2; ++tp) {
    const uint16_t* v0 = v + 2 * tp * g.kv_tok_stride;
    const uint16_t* v1 = v0 + g.kv_tok_stride;
    for (int64_t c = 0; c < g.head_dim; c += kLanes) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c));
      const __m256i b = 2 * tp + 1 < nt ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c))
                                        : _mm256_setzero_si256();
      _mm512_storeu_si512(s.vp.data() + tp * g.head_dim + c, pair_up(a, b));
    }
  }
}
#endif

template <typename T, int C>
inline void weigh_chunks(Scratch& s, const Geometry& g, float* acc, const float* alpha, int64_t r, int64_t c0,
                         const T* vb, int64_t n) {
#if defined(__AVX512BF16__)
  if constexpr (native_bf16<T>()) {
    return weigh_values_bf16<kRowsInFlight, C>(acc, g.head_dim, alpha + r, s.pp.data() + r, s.vp.data() + c0 * kLanes,
                                              (n + 1) / 2);
  }
#endif
  weigh_values<T, kRowsInFlight, C>(acc, g.head_dim, alpha + r, s.scores.data() + r, vb + c0 * kLanes, g.kv_tok_stride,
                                    n);
}

template <typename T>
void group_values(Scratch& s, const Geometry& g, int64_t group_index, const T* vb, int64_t n, fvec alpha) {
  alignas(64) float alphas[kLanes];
  vstore(alphas, alpha);
#if defined(__AVX512BF16__)
  if constexpr (native_bf16<T>()) pair_weights(s, s.scores.data(), n);
#endif
  const int64_t chunks = g.head_dim / kLanes;
  for (int64_t r = 0; r < kLanes; r += kRowsInFlight) {
    for (int64_t c0 = 0; c0 < chunks; c0 += kChunksInFlight) {
      float* acc = s.acc.data() + (group_index * kLanes + r) * g.head_dim + c0 * kLanes;
      switch (std::min<int64_t>(kChunksInFlight, chunks - c0)) {
        case 1: weigh_chunks<T, 1>(s, g, acc, alphas, r, c0, vb, n); break;
        case 2: weigh_chunks<T, 2>(s, g, acc, alphas, r, c0, vb, n); break;
        case 3: weigh_chunks<T, 3>(s, g, acc, alphas, r, c0, vb, n); break;
        default: weigh_chunks<T, 4>(s, g, acc, alphas, r, c0, vb, n); break;
      }
    }
  }
}
static_assert(kChunksInFlight == 4, "group_values dispatches 1 .. 4 chunks");

// --- one work item ------------------------------------------------------------------------------------

// The query of row r (of `rows`, grouped by kLanes) in the layout the score loop takes.
template <typename T>
void load_query(Scratch& s, const Geometry& g, const T* src, int64_t r) {
  const int64_t group_index = r / kLanes, lane = r % kLanes;
  if constexpr (native_bf16<T>()) {
    uint32_t* dst = s.qp.data() + group_index * (g.head_dim / 2) * kLanes + lane;
    for (int64_t dp = 0; dp < g.head_dim / 2; ++dp) std::memcpy(dst + dp * kLanes, src + 2 * dp, 4);
  } else {
    float* dst = s.q.data() + group_index * g.head_dim * kLanes + lane;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d * kLanes] = widen(src[d]) * g.scale;
  }
}

// One block of one KV head, 8-bit codes times their scales, as nt rows of T (head_dim apart) in `buf`.
template <typename T, typename C>
const T* widen_block(std::vector<float>& buf, const Geometry& g, const C* codes, const c10::BFloat16* scales,
                     int64_t nt) {
  buf.resize(g.block_size * g.head_dim);  // float storage holds as many T
  T* dst = reinterpret_cast<T*>(buf.data());
  for (int64_t t = 0; t < nt; ++t) {
    const float sc = widen(scales[t * g.sc_tok_stride]);
    for (int64_t c = 0; c < g.head_dim; c += kLanes)
      vstore(dst + t * g.head_dim + c, vload(codes + t * g.kv_tok_stride + c) * sc);
  }
  return dst;
}

// Rows are (query token, query head of the item's KV head), token-major; row r's token is r / group.
// T: the queries' dtype; C: the cache's elements (T, or 8-bit codes, widened to T a block at a time).
template <typename T, typename C>
void attend_many(const WorkItem& w, const Geometry& cache_geometry, const T* q, const KVRefs<C>& kv,
                 const int32_t* block_table, int64_t first_pos, int64_t query_start, T* out, Scratch& s) {
  Geometry g = cache_geometry;
  if constexpr (is_code<C>()) g.kv_tok_stride = g.head_dim;  // K/V are read from the widened block
  const int64_t rows = w.num_queries * g.group;
  const int64_t groups = (rows + kLanes - 1) / kLanes;
  const auto row_offset = [&](int64_t r) {  // the row's token and head, as an offset into q and out
    return (query_start + w.first_query + r / g.group) * g.q_tok_stride + (w.kv_head * g.group + r % g.group) * g.q_head_stride;
  };
  // Rows past the last stay zero: finite scores, never written out.
  s.qp.assign(native_bf16<T>() ? groups * g.head_dim / 2 * kLanes : 0, 0u);
  s.q.assign(native_bf16<T>() ? 0 : groups * g.head_dim * kLanes, 0.f);
  s.m.assign(groups * kLanes, -1e30f);
  s.l.assign(groups * kLanes, 0.f);
  s.acc.assign(groups * kLanes * g.head_dim, 0.f);
  if (static_cast<int64_t>(s.scores.size()) < g.block_size * kLanes) s.scores.resize(g.block_size * kLanes);
  s.pp.resize((g.block_size / 2 + 1) * kLanes);
  s.vp.resize((g.block_size / 2 + 1) * g.head_dim);
  std::vector<int32_t> row_pos(groups * kLanes, 1 << 30);  // padding rows see every token: never masked
  std::vector<int32_t> row_low(groups * kLanes, -(1 << 30));  // a window's first key of the row (or none)
  for (int64_t r = 0; r < rows; ++r) {
    load_query(s, g, q + row_offset(r), r);
    row_pos[r] = static_cast<int32_t>(first_pos + r / g.group);
    if (g.window) row_low[r] = static_cast<int32_t>(row_pos[r] - g.window + 1);
  }
  const int64_t kv_end = first_pos + w.num_queries;
  const int64_t first_key = g.window ? std::max<int64_t>(0, first_pos - g.window + 1) : 0;  // the first row's
  for (int64_t j = first_key / g.block_size; j * g.block_size < kv_end; ++j) {
    const int64_t t0 = j * g.block_size;
    const int64_t nt = std::min(g.block_size, kv_end - t0);
    const int64_t block = block_table[j];
    const T* kb;
    const T* vb;
    if constexpr (is_code<C>()) {
      const int64_t base = block * cache_geometry.kv_block_stride + w.kv_head * cache_geometry.kv_head_stride;
      const int64_t sbase = block * g.sc_block_stride + w.kv_head * g.sc_head_stride;
      kb = widen_block<T>(s.kbuf, cache_geometry, kv.k + base, kv.k_scale + sbase, nt);
      vb = widen_block<T>(s.vbuf, cache_geometry, kv.v + base, kv.v_scale + sbase, nt);
    } else {
      const int64_t base = block * g.kv_block_stride + w.kv_head * g.kv_head_stride;
      kb = kv.k + base;
      vb = kv.v + base;
    }
#if defined(__AVX512BF16__)
    if constexpr (native_bf16<T>()) pair_values(s, g, vb, nt);
#endif
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t first = row_pos[gi * kLanes];  // rows are in position order; a group's first is real
      const int64_t last = first_pos + std::min(rows - 1, gi * kLanes + kLanes - 1) / g.group;
      if (last < t0) continue;  // no row of this group reaches this block
      const int64_t n = std::min(nt, last - t0 + 1);  // tokens the group's last row sees
      const int64_t highest_low = row_low[std::min(rows - 1, gi * kLanes + kLanes - 1)];
      if (g.window && t0 + n <= row_low[gi * kLanes]) continue;  // before every row's window
      ivec visible, lowest;
      std::memcpy(&visible, row_pos.data() + gi * kLanes, sizeof visible);
      visible -= static_cast<int32_t>(t0 - 1);
      std::memcpy(&lowest, row_low.data() + gi * kLanes, sizeof lowest);
      lowest -= static_cast<int32_t>(t0);
      group_scores(s, g, gi, kb, n);
      const fvec alpha = group_softmax(s.scores.data(), n, visible, first - t0 + 1 < n, lowest, highest_low > t0,
                                         s.m.data() + gi * kLanes, s.l.data() + gi * kLanes);
      group_values(s, g, gi, vb, n, alpha);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (query_start + w.first_query + r / g.group) * g.out_tok_stride + (w.kv_head * g.group + r % g.group) * g.head_dim;
    const float inv = 1.f / s.l[r];
    const float* acc = s.acc.data() + r * g.head_dim;
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  }
}

}  // namespace pdserve
