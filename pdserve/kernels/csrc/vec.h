// Float vectors of one machine register, with GCC vector extensions: 16 floats on AVX-512 (and on
// NEON, as four registers of its 32), 8 on x86 without AVX-512. The kernels are written against these
// so one source builds for every CPU (-march=native). The width matters on AVX2: a 16-float vector
// there is two of its 16 registers, too few for the dozen the kernels keep in flight (a 2,048-token
// fp32 prefill's attention ran 11x slower than SDPA on a Zen 3 box; with 8-float vectors, 1.1x faster).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve {

#if defined(__x86_64__) && !defined(__AVX512F__)
#define PDSERVE_VEC8 1  // AVX2: 8-float vectors (many_rows.h's register budgets key on this too)
#endif

#if defined(PDSERVE_VEC8)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 16;
#endif

typedef float fvec __attribute__((vector_size(kLanes * 4)));
typedef int32_t ivec __attribute__((vector_size(kLanes * 4)));
typedef uint32_t uvec __attribute__((vector_size(kLanes * 4)));
typedef uint16_t hvec __attribute__((vector_size(kLanes * 2)));  // kLanes bf16 or fp16 bit patterns

inline fvec splat(float x) { return fvec{} + x; }

inline fvec vload(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline fvec vload(const c10::BFloat16* p) {
  hvec h;
  std::memcpy(&h, p, sizeof h);
  return (fvec)(__builtin_convertvector(h, uvec) << 16);
}

inline fvec vload(const c10::Half* p) {
  fvec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

inline void vstore(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }

inline void vstore(c10::BFloat16* p, fvec v) {  // round to nearest even, as c10::BFloat16 does
  const uvec bits = (uvec)v;
  const uvec rounded = (bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16;
  const hvec h = __builtin_convertvector(rounded, hvec);
  std::memcpy(p, &h, sizeof h);
}

inline void vstore(c10::Half* p, fvec v) {
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

inline float widen(float x) { return x; }
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline float hsum(fvec v) {  // a log tree of halves
#if defined(PDSERVE_VEC8)
  const f32x8 a = v;
#else
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// out[i] = the sum of v[i]'s lanes, for kLanes vectors at once: a transpose tree of shuffles and adds
// (45 for 16 vectors, where 16 separate horizontal sums take 128).
inline fvec reduce_lanes(const fvec* v) {
#if defined(PDSERVE_VEC8)
  fvec b[4], c[2];
  for (int i = 0; i < 4; ++i)  // b[i]: 4 partial sums of v[2i], then 4 of v[2i + 1]
    b[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // c[i]: 2 each of v[4i .. 4i + 3]
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
  fvec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // a[i]: 8 partial sums of v[2i], then 8 of v[2i + 1]
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // b[i]: 4 each of v[4i .. 4i + 3]
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // c[i]: 2 each of v[8i .. 8i + 7]
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#endif
}

inline fvec vmax(fvec a, fvec b) { return a > b ? a : b; }

inline float hmax(fvec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x in [-87, 88] (clamped): 2^(x log2 e) = 2^n * e^f with n = round(x log2 e), |f| <= ln2 / 2,
// e^f by its Taylor series to f^7 (relative error below 1e-8 before rounding).
inline fvec vexp(fvec x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  const fvec t = x * 1.44269504088896341f;
  const fvec half = t < splat(0.f) ? splat(-0.5f) : splat(0.5f);
  const fvec n = __builtin_convertvector(__builtin_convertvector(t + half, ivec), fvec);
  const fvec f = (t - n) * 0.69314718055994531f;
  fvec p = splat(1.f / 5040) * f + 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  return p * (fvec)bits;
}

// In place: s[0..n) = exp(s - m); returns their sum. Lanes past n are left alone.
inline float exp_sum(float* s, int64_t n, float m) {
  fvec sum{};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const fvec e = vexp(vload(s + t) - m);
    std::memcpy(s + t, &e, sizeof e);
    sum += e;
  }
  float total = hsum(sum);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    total += s[t];
  }
  return total;
}

}  // namespace pdserve
