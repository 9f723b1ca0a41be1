// 8-bit KV cache elements (--kv-cache-dtype int8, fp8_e4m3, fp8_e5m2): a code per element and a bf16 scale
// per (token, KV head), so an element is code * scale. The attention paths widen codes in registers
// (vload, widen) and multiply by the scale once per token and head; write_kv encodes (encode_row).
//
// fp8 codes are widened through fp16, which the CPU converts to fp32 in one instruction (F16C): an e5m2
// code is the top byte of the fp16 of the same value; an e4m3 code shifted into fp16's exponent and
// mantissa fields is its value times 2^-8, subnormals included (both formats' subnormals scale alike).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace pdserve {

struct Int8Code { int8_t bits; };
struct E4M3Code { uint8_t bits; };
struct E5M2Code { uint8_t bits; };

template <typename C>
constexpr bool is_code() {
  return std::is_same_v<C, Int8Code> || std::is_same_v<C, E4M3Code> || std::is_same_v<C, E5M2Code>;
}

// The largest code magnitude: a token-head's scale is its largest |element| / kMax.
template <typename C> constexpr float code_max();
template <> constexpr float code_max<Int8Code>() { return 127.f; }
template <> constexpr float code_max<E4M3Code>() { return 448.f; }
template <> constexpr float code_max<E5M2Code>() { return 57344.f; }

typedef int8_t i8vec __attribute__((vector_size(kLanes)));
typedef uint8_t u8vec __attribute__((vector_size(kLanes)));

// kLanes fp16 bit patterns as floats.
inline fvec half_bits_to_float(hvec h) {
#if defined(__F16C__) && defined(__AVX512F__) && !defined(PDSERVE_VEC8)
  __m256i bits;
  std::memcpy(&bits, &h, sizeof h);
  return (fvec)_mm512_cvtph_ps(bits);
#elif defined(__F16C__) && defined(PDSERVE_VEC8)
  __m128i bits;
  std::memcpy(&bits, &h, sizeof h);
  return (fvec)_mm256_cvtph_ps(bits);
#else
  fvec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
  return v;
#endif
}

// (GCC's generic conversions of byte vectors came out several times slower than these instructions.)
inline fvec vload(const Int8Code* p) {
#if defined(__AVX512F__) && !defined(PDSERVE_VEC8)
  return (fvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (fvec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  fvec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i].bits);
  return v;
#endif
}

// kLanes codes as fp16 bit patterns: e5m2 as they are (the top byte), e4m3 shifted (its value times 2^-8).
// For e4m3, the code sign-extended to 16 bits and shifted left by 7 has the sign at bit 15 and the exponent
// and mantissa at bits 7-13; bit 14 (a copy of the sign) is masked off.
template <bool kE4M3>
inline hvec code_halves(const uint8_t* p) {
  hvec h;
#if defined(__AVX512F__) && !defined(PDSERVE_VEC8)
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i y = kE4M3 ? _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7), _mm256_set1_epi16(-16512))
                          : _mm256_slli_epi16(_mm256_cvtepu8_epi16(x), 8);
  std::memcpy(&h, &y, sizeof h);
#elif defined(__AVX2__)
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i y = kE4M3 ? _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(x), 7), _mm_set1_epi16(-16512))
                          : _mm_slli_epi16(_mm_cvtepu8_epi16(x), 8);
  std::memcpy(&h, &y, sizeof h);
#else
  for (int i = 0; i < kLanes; ++i)
    h[i] = kE4M3 ? static_cast<uint16_t>(((p[i] & 0x80) << 8) | ((p[i] & 0x7F) << 7)) : static_cast<uint16_t>(p[i] << 8);
#endif
  return h;
}

// The codes' value in units of code_unit: an e4m3 code's fp16 pattern is its value / 256, and the scale
// arrays of the few-rows path take the 256 once per token instead of once per element.
template <typename C> constexpr float code_unit() { return std::is_same_v<C, E4M3Code> ? 256.f : 1.f; }
inline fvec vload_units(const Int8Code* p) { return vload(p); }
inline fvec vload_units(const E5M2Code* p) { return half_bits_to_float(code_halves<false>(&p->bits)); }
inline fvec vload_units(const E4M3Code* p) { return half_bits_to_float(code_halves<true>(&p->bits)); }
template <typename T> inline fvec vload_units(const T* p) { return vload(p); }  // full-width elements

inline fvec vload(const E5M2Code* p) { return vload_units(p); }
inline fvec vload(const E4M3Code* p) { return vload_units(p) * 256.f; }

inline float widen(Int8Code x) { return static_cast<float>(x.bits); }
inline float widen(E5M2Code x) { return static_cast<float>(c10::Float8_e5m2(x.bits, c10::Float8_e5m2::from_bits())); }
inline float widen(E4M3Code x) {
  return static_cast<float>(c10::Float8_e4m3fn(x.bits, c10::Float8_e4m3fn::from_bits()));
}

// The units of codes_as_bf16's products (below).
template <typename C> constexpr float kPartnerUnit = std::is_same_v<C, Int8Code> ? 1.f : 0x1p64f;
template <typename C> constexpr float kSumUnit =
    std::is_same_v<C, Int8Code> ? 1.f : (std::is_same_v<C, E4M3Code> ? 0x1p56f : 0x1p48f);

#if defined(__AVX512BF16__)
// 32 codes as bf16 bit patterns, for native bf16 dot products. An fp8 code sign-extended to 16 bits and shifted
// has its exponent and mantissa in bf16's fields (its sign's copies masked off): its value times 2^-120 (e4m3)
// or 2^-112 (e5m2), so the other factor of each product carries kPartnerUnit (2^64) and the sums kSumUnit,
// keeping them far from fp32's smallest normals. Subnormal fp8 codes (below 2^-15 of their row's largest) are
// zero to these instructions. An int8 code becomes its exact bf16 through fp32.
template <typename C>
inline __m512i codes_as_bf16(const C* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (std::is_same_v<C, Int8Code>) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(x)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(x, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    constexpr bool e4m3 = std::is_same_v<C, E4M3Code>;
    const __m512i wide = _mm512_slli_epi16(_mm512_cvtepi8_epi16(x), e4m3 ? 4 : 5);
    return _mm512_and_si512(wide, _mm512_set1_epi16(e4m3 ? int16_t(0x87F0) : int16_t(0x8FE0)));
  }
}
#endif

// One code of x / scale (x already divided), rounded to nearest and held inside the code's range (c10's
// fp8 conversions turn what lies past it into NaN or inf).
template <typename C> C encode(float x);
template <> inline Int8Code encode<Int8Code>(float x) {
  return {static_cast<int8_t>(std::nearbyint(std::clamp(x, -127.f, 127.f)))};
}
template <> inline E4M3Code encode<E4M3Code>(float x) {
  return {c10::Float8_e4m3fn(std::clamp(x, -448.f, 448.f)).x};
}
template <> inline E5M2Code encode<E5M2Code>(float x) {
  return {c10::Float8_e5m2(std::clamp(x, -57344.f, 57344.f)).x};
}

// codes[0, n) and *scale for one token-head's row x[0, n): scale = max |x| / code_max, rounded to bf16, and
// the codes divided by the rounded scale (so a code's error is its own rounding only).
template <typename C, typename T>
inline void encode_row(const T* x, int64_t n, C* codes, c10::BFloat16* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(widen(x[i])));
  const c10::BFloat16 s(amax / code_max<C>());
  const float sf = static_cast<float>(s);
  for (int64_t i = 0; i < n; ++i) codes[i] = encode<C>(sf > 0.f ? widen(x[i]) / sf : 0.f);
  *scale = s;
}

}  // namespace pdserve
