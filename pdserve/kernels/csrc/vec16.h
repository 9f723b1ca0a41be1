// 16-float vectors with GCC vector extensions: one AVX-512 register, two AVX2 ones, four NEON ones.
// The kernels are written against these so one source builds for every CPU (-march=native).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

constexpr int64_t kLanes = 16;

inline f32x16 splat(float x) { return f32x16{} + x; }

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x16 load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
}

inline f32x16 load16(const c10::Half* p) {
  f32x16 v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline void store16(c10::BFloat16* p, f32x16 v) {  // round to nearest even, as c10::BFloat16 does
  const u32x16 bits = (u32x16)v;
  const u32x16 rounded = (bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16;
  const u16x16 h = __builtin_convertvector(rounded, u16x16);
  std::memcpy(p, &h, sizeof h);
}

inline void store16(c10::Half* p, f32x16 v) {
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

inline float hsum(f32x16 v) {  // a log tree of halves: 4 shuffles and 4 adds
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// out[i] = the sum of v[i]'s lanes, for 16 vectors at once: a transpose tree of 45 shuffles and adds
// where 16 separate horizontal sums take 128.
inline f32x16 reduce16(const f32x16* v) {
  f32x16 a[8], b[4], c[2];
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
}

inline f32x16 vmax(f32x16 a, f32x16 b) { return a > b ? a : b; }

inline float hmax(f32x16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x in [-87, 88] (clamped): 2^(x log2 e) = 2^n * e^f with n = round(x log2 e), |f| <= ln2 / 2,
// e^f by its Taylor series to f^7 (relative error below 1e-8 before rounding).
inline f32x16 exp16(f32x16 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  const f32x16 t = x * 1.44269504088896341f;
  const f32x16 half = t < splat(0.f) ? splat(-0.5f) : splat(0.5f);
  const f32x16 n = __builtin_convertvector(__builtin_convertvector(t + half, i32x16), f32x16);
  const f32x16 f = (t - n) * 0.69314718055994531f;
  f32x16 p = splat(1.f / 5040) * f + 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  return p * (f32x16)bits;
}

// In place: s[0..n) = exp(s - m); returns their sum. Lanes past n are left alone.
inline float exp_sum(float* s, int64_t n, float m) {
  f32x16 sum{};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const f32x16 e = exp16(load16(s + t) - m);
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
