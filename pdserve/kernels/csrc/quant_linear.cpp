// y = x @ W.T (+ bias) (+ residual) with W kept in GGUF's block formats, repacked once at load.
//
// Every format pdserve keeps packed (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is, block by block, an
// affine map of small unsigned codes: w = scale * code + min, over blocks of `group` (32, or 16 for Q6_K) inputs
// of one output row. Formats without a stored min have a fixed one, min = -offset * scale (Q4_0: 8, Q8_0: 128,
// Q5_0: 16, Q6_K: 32). Codes take the bits of their format: 4 (Q4_*), 5 (Q5_*), 6 (Q6_K) or 8 (Q8_0), so the
// packed weight is as large as the file's.
//
// Packed layout: groups of 16 output rows, one after the other; inside a group, one record per input block:
//   16 fp16 scales, then (has_min) 16 fp16 mins, then the codes in chunks of 64 bytes, chunk j holding for
//   each of the 16 rows 4 consecutive inputs (row r at bytes 4r .. 4r + 3). 8 bits: chunk j is inputs
//   4j .. 4j + 3. 4 to 6 bits: the low nibbles of chunk j are the low 4 bits of inputs 4j .. 4j + 3, the high
//   nibbles those of the same inputs group / 2 further on; 5 and 6 bits: after the nibbles, one bit plane per
//   bit above the fourth, each 8 bytes per chunk and nibble half (plane p, chunk j, half h at byte
//   2 * group * p + 16 * j + 8 * h): bit 4r + i of that little-endian word is bit 4 + p of the code that sits
//   at byte 4r + i of the chunk's nibbles.
// So one 64-byte load is 16 rows by 4 inputs: exactly what VNNI's vpdpbusd multiplies (u8 codes by s8
// activations, 4 products summed into each of 16 int32 lanes); a plane's word is a mask that adds 16 or 32 to
// the bytes it marks.
//
// Activations are quantized per block to int8 (scale = max |x| / 127) when a call starts, as llama.cpp does:
//   sum_k w x = sum_blocks scale_w * scale_x * (sum codes * xq) + min_w * scale_x * sum xq.
// AVX2 without VNNI multiplies with vpmaddubsw, whose 16-bit pair sums saturate past 32767: codes up to 127 are
// safe (two products of 127 * 127), 8-bit codes of Q8_0 are taken as signed (code - 128, in [-127, 127]) with the
// sign trick instead; the packer never writes a Q8_0 code 0 (-128) for that reason.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstring>
#include <optional>

#include "vec.h"

using namespace pdserve;

namespace {

constexpr int64_t kGroupRows = 16;
constexpr int64_t kMaxRows = 1 << 20;
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead the weight stream is prefetched (3B shapes: ~+15% over 2 KB)

struct Format {
  int64_t bits, group, offset;
  bool has_min;
  int64_t scale_bytes() const { return kGroupRows * 2 * (has_min ? 2 : 1); }
  int64_t block_bytes() const { return scale_bytes() + kGroupRows * group * bits / 8; }
};

struct Job {
  Format f;
  int64_t rows, n, k, blocks;  // x's rows, outputs, inputs, input blocks (k / group)
  const uint8_t* packed;
  const int8_t* xq;        // [rows, k]
  const float* xscale;     // [rows, blocks]
  const int32_t* xsum;     // [rows, blocks]
  int64_t group_bytes() const { return blocks * f.block_bytes(); }
};

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Input i's code for row `row` of a block record's codes (the layout above), one at a time: the plain-C++ kernel
// and the dequantizer read it so.
inline int code_at(const uint8_t* q, int bits, int group, int row, int i) {
  if (bits == 8) return q[64 * (i / 4) + 4 * row + i % 4];
  const int half = i >= group / 2;
  const int j = (i % (group / 2)) / 4;
  const int at = 4 * row + i % 4;
  const uint8_t byte = q[64 * j + at];
  int code = half ? byte >> 4 : byte & 0x0F;
  for (int p = 0; p < bits - 4; ++p) {
    const uint8_t* plane = q + 8 * group + 2 * group * p + 16 * j + 8 * half;
    code |= ((plane[at / 8] >> (at % 8)) & 1) << (4 + p);
  }
  return code;
}

// x [rows, k] -> int8 codes per block of `group`, with each block's scale and code sum.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t group, int8_t* q, float* scale, int32_t* sum) {
  const int64_t blocks = k / group;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const T* xb = x + r * k + b * group;
        float amax = 0.f;
        for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(to_float(xb[i])));
        const float s = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t total = 0;
        int8_t* qb = q + r * k + b * group;
        for (int64_t i = 0; i < group; ++i) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(to_float(xb[i]) * inv));
          qb[i] = static_cast<int8_t>(v);
          total += v;
        }
        scale[r * blocks + b] = s;
        sum[r * blocks + b] = total;
      }
  });
}

// One row block's 16 outputs, finished: bias and residual added, stored in the output dtype.
template <typename T>
inline void store16(const float* acc, T* out, const T* bias, const T* residual) {
  for (int i = 0; i < kGroupRows; ++i) {
    float v = acc[i];
    if (bias != nullptr) v += to_float(bias[i]);
    if (residual != nullptr) v += to_float(residual[i]);
    out[i] = static_cast<T>(v);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
constexpr int kRowChunk = 8;

inline __mmask64 load_mask64(const uint8_t* p) {
  uint64_t m;
  std::memcpy(&m, p, sizeof m);
  return _cvtu64_mask64(m);
}

// acc[m][0..16): row (row0 + m)'s outputs of group g, for MR rows.
template <int Bits, int G, bool HasMin, int MR>
void group_dot(const Job& job, int64_t g, int64_t row0, float (*acc)[kGroupRows]) {
  constexpr int kChains = MR >= 4 ? 1 : MR >= 2 ? 2 : 4;
  const Format& f = job.f;
  const int64_t bb = f.block_bytes();
  const uint8_t* blk = job.packed + g * job.group_bytes();
  __m512 facc[MR];
  for (int m = 0; m < MR; ++m) facc[m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < job.blocks; ++b, blk += bb) {
    for (int64_t line = 0; line < bb; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 mn = _mm512_setzero_ps();
    if constexpr (HasMin) mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    const uint8_t* q = blk + (HasMin ? 64 : 32);
    const int8_t* xb = job.xq + row0 * job.k + b * G;
    // vpdpbusd has a latency of several cycles: with few rows, independent sums (chains) keep it busy.
    __m512i iacc[MR][kChains];
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < kChains; ++c) iacc[m][c] = _mm512_setzero_si512();
    if constexpr (Bits == 8) {
      for (int j = 0; j < G / 4; ++j) {
        const __m512i w = _mm512_loadu_si512(q + 64 * j);
        for (int m = 0; m < MR; ++m)
          iacc[m][j % kChains] = _mm512_dpbusd_epi32(iacc[m][j % kChains], w,
                                                     _mm512_set1_epi32(load_i32(xb + m * job.k + 4 * j)));
      }
    } else {
      for (int j = 0; j < G / 8; ++j) {
        const __m512i v = _mm512_loadu_si512(q + 64 * j);
        __m512i lo = _mm512_and_si512(v, nibble);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int p = 0; p < Bits - 4; ++p) {  // 5 and 6 bits: the planes' masks add 16, 32
          const uint8_t* plane = q + 8 * G + 2 * G * p + 16 * j;
          const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << p));
          lo = _mm512_mask_add_epi8(lo, load_mask64(plane), lo, bit);
          hi = _mm512_mask_add_epi8(hi, load_mask64(plane + 8), hi, bit);
        }
        for (int m = 0; m < MR; ++m) {
          const int c = (2 * j) % kChains, c2 = (2 * j + 1) % kChains;
          iacc[m][c] = _mm512_dpbusd_epi32(iacc[m][c], lo, _mm512_set1_epi32(load_i32(xb + m * job.k + 4 * j)));
          iacc[m][c2] = _mm512_dpbusd_epi32(iacc[m][c2], hi,
                                            _mm512_set1_epi32(load_i32(xb + m * job.k + G / 2 + 4 * j)));
        }
      }
    }
    __m512i isum[MR];
    for (int m = 0; m < MR; ++m) {
      isum[m] = iacc[m][0];
      for (int c = 1; c < kChains; ++c) isum[m] = _mm512_add_epi32(isum[m], iacc[m][c]);
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (row0 + m) * job.blocks + b;
      const float xs = job.xscale[at];
      if constexpr (HasMin) {
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(s, _mm512_set1_ps(xs)), facc[m]);
        facc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs * static_cast<float>(job.xsum[at])), facc[m]);
      } else {
        const __m512i centered = _mm512_sub_epi32(isum[m], _mm512_set1_epi32(static_cast<int32_t>(f.offset) * job.xsum[at]));
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centered), _mm512_mul_ps(s, _mm512_set1_ps(xs)), facc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(acc[m], facc[m]);
}

#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr int kRowChunk = 4;

inline __m256i dot4(__m256i w, __m256i x, bool signed_codes) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (signed_codes) {  // codes - 128 as s8: |x| times w with x's sign, pairs within 16 bits
    const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(ws, x)), ones);
  }
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
}

// 32 bits of a plane word as bytes: `value` where the bit is set, 0 elsewhere.
inline __m256i plane_bytes(const uint8_t* p, char value) {
  uint32_t m;
  std::memcpy(&m, p, sizeof m);
  const __m256i spread = _mm256_shuffle_epi8(  // byte i gets byte i / 8 of m
      _mm256_set1_epi32(static_cast<int32_t>(m)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));  // byte i: bit i % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(value));
}

// As the AVX-512 version, eight rows of the group at a time (half = 0, 1): 8 int32 lanes a register.
template <int Bits, int G, bool HasMin, int MR>
void group_dot(const Job& job, int64_t g, int64_t row0, float (*acc)[kGroupRows]) {
  const Format& f = job.f;
  const int64_t bb = f.block_bytes();
  const bool signed_codes = Bits == 8 && f.offset == 128;
  const int32_t offset = signed_codes ? 0 : static_cast<int32_t>(f.offset);  // the sign trick centres already
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* blk = job.packed + g * job.group_bytes();
    __m256 facc[MR];
    for (int m = 0; m < MR; ++m) facc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < job.blocks; ++b, blk += bb) {
      if (half == 0)
        for (int64_t line = 0; line < bb; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * half)));
      __m256 mn = _mm256_setzero_ps();
      if constexpr (HasMin) mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * half)));
      const uint8_t* q = blk + (HasMin ? 64 : 32) + 32 * half;
      const uint8_t* planes = blk + (HasMin ? 64 : 32) + 8 * G;
      const int8_t* xb = job.xq + row0 * job.k + b * G;
      __m256i iacc[MR];
      for (int m = 0; m < MR; ++m) iacc[m] = _mm256_setzero_si256();
      if constexpr (Bits == 8) {
        for (int j = 0; j < G / 4; ++j) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * j));
          for (int m = 0; m < MR; ++m)
            iacc[m] = _mm256_add_epi32(iacc[m], dot4(w, _mm256_set1_epi32(load_i32(xb + m * job.k + 4 * j)), signed_codes));
        }
      } else {
        for (int j = 0; j < G / 8; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * j));
          __m256i lo = _mm256_and_si256(v, nibble);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          for (int p = 0; p < Bits - 4; ++p) {  // 5 and 6 bits: this half's 32 bits of each plane word
            const uint8_t* plane = planes + 2 * G * p + 16 * j + 4 * half;
            lo = _mm256_or_si256(lo, plane_bytes(plane, static_cast<char>(16 << p)));
            hi = _mm256_or_si256(hi, plane_bytes(plane + 8, static_cast<char>(16 << p)));
          }
          for (int m = 0; m < MR; ++m) {
            iacc[m] = _mm256_add_epi32(iacc[m], dot4(lo, _mm256_set1_epi32(load_i32(xb + m * job.k + 4 * j)), false));
            iacc[m] = _mm256_add_epi32(iacc[m], dot4(hi, _mm256_set1_epi32(load_i32(xb + m * job.k + G / 2 + 4 * j)), false));
          }
        }
      }
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (row0 + m) * job.blocks + b;
        const float xs = job.xscale[at];
        if constexpr (HasMin) {
          facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m]), _mm256_mul_ps(s, _mm256_set1_ps(xs)), facc[m]);
          facc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs * static_cast<float>(job.xsum[at])), facc[m]);
        } else {
          const __m256i centered = _mm256_sub_epi32(iacc[m], _mm256_set1_epi32(offset * job.xsum[at]));
          facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centered), _mm256_mul_ps(s, _mm256_set1_ps(xs)), facc[m]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(acc[m] + 8 * half, facc[m]);
  }
}

#else
constexpr int kRowChunk = 4;

// Plain C++ for CPUs without AVX2: the same arithmetic, one product at a time.
template <int Bits, int G, bool HasMin, int MR>
void group_dot(const Job& job, int64_t g, int64_t row0, float (*acc)[kGroupRows]) {
  const Format& f = job.f;
  const int64_t bb = f.block_bytes();
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < kGroupRows; ++r) acc[m][r] = 0.f;
  const uint8_t* blk = job.packed + g * job.group_bytes();
  for (int64_t b = 0; b < job.blocks; ++b, blk += bb) {
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk);
    const uint8_t* q = blk + (HasMin ? 64 : 32);
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (row0 + m) * job.blocks + b;
      const int8_t* xb = job.xq + (row0 + m) * job.k + b * G;
      for (int r = 0; r < kGroupRows; ++r) {
        int32_t dot = 0;
        for (int i = 0; i < G; ++i) dot += code_at(q, Bits, G, r, i) * xb[i];
        const float s = half_to_float(scales[r]) * job.xscale[at];
        if constexpr (HasMin)
          acc[m][r] += s * dot + half_to_float(scales[kGroupRows + r]) * job.xscale[at] * job.xsum[at];
        else
          acc[m][r] += s * (dot - static_cast<int32_t>(f.offset) * job.xsum[at]);
      }
    }
  }
}
#endif

template <int Bits, int G, bool HasMin, typename T>
void run(const Job& job, T* out, const T* bias, const T* residual) {
  at::parallel_for(0, job.n / kGroupRows, 1, [&](int64_t begin, int64_t end) {
    float acc[kRowChunk][kGroupRows];
    for (int64_t g = begin; g < end; ++g)
      for (int64_t row0 = 0; row0 < job.rows; row0 += kRowChunk) {
        const int64_t mr = std::min<int64_t>(kRowChunk, job.rows - row0);
        switch (mr) {
          case 1: group_dot<Bits, G, HasMin, 1>(job, g, row0, acc); break;
          case 2: group_dot<Bits, G, HasMin, 2>(job, g, row0, acc); break;
          case 3: group_dot<Bits, G, HasMin, 3>(job, g, row0, acc); break;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
          case 4: group_dot<Bits, G, HasMin, 4>(job, g, row0, acc); break;
          case 5: group_dot<Bits, G, HasMin, 5>(job, g, row0, acc); break;
          case 6: group_dot<Bits, G, HasMin, 6>(job, g, row0, acc); break;
          case 7: group_dot<Bits, G, HasMin, 7>(job, g, row0, acc); break;
          default: group_dot<Bits, G, HasMin, 8>(job, g, row0, acc); break;
#else
          default: group_dot<Bits, G, HasMin, 4>(job, g, row0, acc); break;
#endif
        }
        for (int64_t m = 0; m < mr; ++m) {
          const int64_t row = row0 + m, col = g * kGroupRows;
          store16(acc[m], out + row * job.n + col, bias == nullptr ? nullptr : bias + col,
                  residual == nullptr ? nullptr : residual + row * job.n + col);
        }
      }
  });
}

template <typename T>
void dispatch(const Job& job, T* out, const T* bias, const T* residual) {
  const Format& f = job.f;
  if (f.bits == 4 && f.group == 32 && !f.has_min) return run<4, 32, false>(job, out, bias, residual);  // Q4_0
  if (f.bits == 4 && f.group == 32 && f.has_min) return run<4, 32, true>(job, out, bias, residual);  // Q4_1, Q4_K
  if (f.bits == 5 && f.group == 32 && !f.has_min) return run<5, 32, false>(job, out, bias, residual);  // Q5_0
  if (f.bits == 5 && f.group == 32 && f.has_min) return run<5, 32, true>(job, out, bias, residual);  // Q5_1, Q5_K
  if (f.bits == 6 && f.group == 16 && !f.has_min) return run<6, 16, false>(job, out, bias, residual);  // Q6_K
  if (f.bits == 8 && f.group == 32 && !f.has_min) return run<8, 32, false>(job, out, bias, residual);  // Q8_0
  TORCH_CHECK(false, "quant_linear: no kernel for ", f.bits, "-bit codes in groups of ", f.group,
              f.has_min ? " with mins" : "");
}

Format checked_format(int64_t bits, int64_t group, int64_t offset, bool has_min) {
  TORCH_CHECK((bits >= 4 && bits <= 6) || bits == 8, "quant_linear: codes of 4, 5, 6 or 8 bits");
  TORCH_CHECK(group == 16 || group == 32, "quant_linear: blocks of 16 or 32 inputs");
  return Format{bits, group, offset, has_min};
}

void check_packed(const at::Tensor& packed, const Format& f, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: contiguous uint8");
  TORCH_CHECK(n % kGroupRows == 0 && k % f.group == 0, "n must be whole groups of 16 rows, k whole blocks");
  TORCH_CHECK(packed.numel() == n / kGroupRows * (k / f.group) * f.block_bytes(), "packed: wrong size for ", n,
              " x ", k);
}

}  // namespace

// x [rows, k] (float32 or bfloat16, contiguous); packed: a weight of n outputs and k inputs in the layout above.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits, int64_t group,
                        int64_t offset, bool has_min, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  const Format f = checked_format(bits, group, offset, has_min);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows, "x: contiguous [rows, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const int64_t rows = x.size(0), k = x.size(1);
  check_packed(packed, f, n, k);
  for (const auto* t : {&bias, &residual})
    TORCH_CHECK(!t->has_value() || ((*t)->is_contiguous() && (*t)->scalar_type() == x.scalar_type()),
                "bias and residual: contiguous, of x's dtype");
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "bias: [n]");
  TORCH_CHECK(!residual.has_value() || (residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == n),
              "residual: [rows, n]");
  const int64_t blocks = k / group;
  at::Tensor xq = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor xscale = at::empty({rows, blocks}, x.options().dtype(at::kFloat));
  at::Tensor xsum = at::empty({rows, blocks}, x.options().dtype(at::kInt));
  at::Tensor out = at::empty({rows, n}, x.options());
  const Job job{f, rows, n, k, blocks, packed.data_ptr<uint8_t>(), xq.data_ptr<int8_t>(), xscale.data_ptr<float>(),
                xsum.data_ptr<int32_t>()};
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), rows, k, group, xq.data_ptr<int8_t>(), xscale.data_ptr<float>(),
                  xsum.data_ptr<int32_t>());
    dispatch<float>(job, out.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                    residual.has_value() ? residual->data_ptr<float>() : nullptr);
  } else {
    using B = c10::BFloat16;
    quantize_rows(x.data_ptr<B>(), rows, k, group, xq.data_ptr<int8_t>(), xscale.data_ptr<float>(),
                  xsum.data_ptr<int32_t>());
    dispatch<B>(job, out.data_ptr<B>(), bias.has_value() ? bias->data_ptr<B>() : nullptr,
                residual.has_value() ? residual->data_ptr<B>() : nullptr);
  }
  return out;
}

// The weight's rows `ids` as real numbers [len(ids), k] of `dtype`: an embedding lookup, or the whole matrix
// for a many-row matmul elsewhere.
at::Tensor quant_dequantize(const at::Tensor& packed, int64_t n, int64_t k, int64_t bits, int64_t group,
                            int64_t offset, bool has_min, const at::Tensor& ids, at::ScalarType dtype) {
  const Format f = checked_format(bits, group, offset, has_min);
  check_packed(packed, f, n, k);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids: int64 [rows]");
  at::Tensor index = ids.contiguous();
  const int64_t* rows = index.data_ptr<int64_t>();
  at::Tensor out = at::empty({index.numel(), k}, packed.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t blocks = k / group, bb = f.block_bytes();
  for (int64_t i = 0; i < index.numel(); ++i) TORCH_CHECK(rows[i] >= 0 && rows[i] < n, "id ", rows[i], " out of range");
  at::parallel_for(0, index.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = rows[i] / kGroupRows, r = rows[i] % kGroupRows;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = base + (g * blocks + b) * bb;
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk);
        const float s = half_to_float(scales[r]);
        const float mn = has_min ? half_to_float(scales[kGroupRows + r]) : -static_cast<float>(offset) * s;
        const uint8_t* q = blk + f.scale_bytes();
        float* ob = o + i * k + b * group;
        for (int64_t t = 0; t < group; ++t) {
          ob[t] = s * static_cast<float>(code_at(q, bits, group, r, t)) + mn;
        }
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

TORCH_LIBRARY_FRAGMENT(pdserve_kernels, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int n, int bits, int group, int offset, bool has_min, Tensor? bias, "
        "Tensor? residual) -> Tensor");
  m.def("quant_dequantize(Tensor packed, int n, int k, int bits, int group, int offset, bool has_min, Tensor ids, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
