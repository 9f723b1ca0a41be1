// y = x @ W.T (+ bias) (+ residual) for a few rows of x, reading W where oneDNN packed it.
//
// With a few rows a linear layer is a read of its weight: the step is memory-bound, and oneDNN's matmul
// read the weights at ~30 GB/s on a 2-core AVX-512 box whose read bandwidth is ~58. This kernel streams the
// packed weight once (prefetched ahead), every row of x riding along, so the decoder keeps one copy of each
// weight: oneDNN's, which large batches and prefills still use.
//
// The packed layout, for a weight of N outputs and K inputs: blocks of NB outputs one after the other;
// inside a block, K / P groups of P consecutive inputs, each group NB outputs by P inputs, inputs fastest
// ([N / NB][K / P][NB][P]; P = 2 for bf16, the pairs a dot-product instruction takes, 1 for fp32).
// The Python side reads NB and P from a packed probe and checks the kernel against
// oneDNN on every weight shape before it is used, so another oneDNN's layout is refused, not misread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <optional>
#include <string>

#include "vec.h"

using namespace pdserve;

namespace {

constexpr int64_t kMaxRows = 64;
// How far ahead the weight stream is prefetched, in input groups (P inputs by a block of outputs): 4 KB
// for blocks of 64 bf16 pairs. Without it the 2-core AVX-512 box read at ~40 GB/s, with it ~58 (its read
// bandwidth).
constexpr int64_t kPrefetchGroups = 16;
// Outputs a task computes: a whole block (with slices of half a block each thread fetched every line twice).
constexpr int64_t kSlice = 64;

struct Job {
  int64_t rows, n, k, block, item;  // x's rows, outputs, inputs, NB, bytes an element
  const void* weight;
  const void* x;
  const void* bias;      // [n] or null
  const void* residual;  // [rows, n] or null
  void* out;             // [rows, n]
};

template <typename T>
inline fvec load_or_zero(const T* p, int64_t i) {
  return p == nullptr ? fvec{} : vload(p + i);
}

// acc[m][j]: row m's outputs col + 16 j ... col + 16 j + 15 (kLanes j on 8-lane machines), finished.
template <typename T, int M, int J>
inline void store_slice(const Job& job, fvec (&acc)[M][J], int64_t col) {
  const T* bias = static_cast<const T*>(job.bias);
  const T* residual = static_cast<const T*>(job.residual);
  T* out = static_cast<T*>(job.out);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) {
      const int64_t i = m * job.n + col + j * kLanes;
      vstore(out + i, acc[m][j] + load_or_zero(bias, col + j * kLanes) +
                          (residual == nullptr ? fvec{} : vload(residual + i)));
    }
}

template <int M>
void fp32_slice(const Job& job, int64_t col) {
  constexpr int J = kSlice / kLanes;
  const float* x = static_cast<const float*>(job.x);
  const int64_t block = col / job.block;
  const float* w = static_cast<const float*>(job.weight) + block * job.block * job.k + col % job.block;
  fvec acc[M][J] = {};
  for (int64_t k = 0; k < job.k; ++k, w += job.block) {
    fvec xs[M];
    for (int m = 0; m < M; ++m) xs[m] = splat(x[m * job.k + k]);
    for (int j = 0; j < J; ++j) {
      __builtin_prefetch(w + kPrefetchGroups * job.block + j * kLanes);
      const fvec wv = vload(w + j * kLanes);
      for (int m = 0; m < M; ++m) acc[m][j] += wv * xs[m];
    }
  }
  store_slice<float, M, J>(job, acc, col);
}

#if defined(__AVX512BF16__)
template <int M>
void bf16_slice(const Job& job, int64_t col) {
  constexpr int J = kSlice / 16;
  const auto* x = static_cast<const c10::BFloat16*>(job.x);
  const int64_t block = col / job.block;
  const auto* w = static_cast<const c10::BFloat16*>(job.weight) + block * job.block * job.k + 2 * (col % job.block);
  __m512 acc[M][J];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < job.k; k += 2, w += 2 * job.block) {
    __m512bh xs[M];
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * job.k + k, sizeof pair);
      xs[m] = (__m512bh)_mm512_set1_epi32(pair);
    }
    for (int j = 0; j < J; ++j) {
      __builtin_prefetch(w + 2 * kPrefetchGroups * job.block + j * 32);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * 32);
      for (int m = 0; m < M; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv, xs[m]);
    }
  }
  fvec out[M][J];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) std::memcpy(&out[m][j], &acc[m][j], sizeof(fvec));
  store_slice<c10::BFloat16, M, J>(job, out, col);
}
#endif

// Rows in chunks of up to 8 (the accumulators one core's registers hold); a slice's weight is read from memory
// for the first chunk and from the cache for the rest.
template <template <int> class Slice>
void run(const Job& job) {
  at::parallel_for(0, job.n / kSlice, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t row = 0; row < job.rows; row += 8) {
        Job chunk = job;
        chunk.rows = std::min<int64_t>(8, job.rows - row);
        chunk.x = static_cast<const char*>(job.x) + row * job.k * job.item;
        chunk.out = static_cast<char*>(job.out) + row * job.n * job.item;
        if (job.residual != nullptr) chunk.residual = static_cast<const char*>(job.residual) + row * job.n * job.item;
        switch (chunk.rows) {
          case 1: Slice<1>::run(chunk, s * kSlice); break;
          case 2: Slice<2>::run(chunk, s * kSlice); break;
          case 3: Slice<3>::run(chunk, s * kSlice); break;
          case 4: Slice<4>::run(chunk, s * kSlice); break;
          case 5: Slice<5>::run(chunk, s * kSlice); break;
          case 6: Slice<6>::run(chunk, s * kSlice); break;
          case 7: Slice<7>::run(chunk, s * kSlice); break;
          default: Slice<8>::run(chunk, s * kSlice); break;
        }
      }
    }
  });
}

template <int M>
struct Fp32Slice {
  static void run(const Job& job, int64_t col) { fp32_slice<M>(job, col); }
};

#if defined(__AVX512BF16__)
template <int M>
struct Bf16Slice {
  static void run(const Job& job, int64_t col) { bf16_slice<M>(job, col); }
};
#endif

}  // namespace

// Whether this build can run a packed weight of `dtype` ("bfloat16" needs AVX512_BF16; "float32" runs anywhere).
bool few_row_linear_supports(const std::string& dtype) {
#if defined(__AVX512BF16__)
  if (dtype == "bfloat16") return true;
#endif
  return dtype == "float32";
}

// weight: the address of oneDNN's packed copy of a [n, k] weight (its owner keeps it alive), blocks of `block`
// outputs. x: [rows <= 4, k] contiguous, of the weight's dtype; bias [n] and residual [rows, n] optional.
at::Tensor few_row_linear(const at::Tensor& x, int64_t weight, int64_t n, int64_t block,
                          const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "x: contiguous [rows, k] with 1 to ", kMaxRows, " rows");
  TORCH_CHECK(block % kSlice == 0 && n % block == 0 && x.size(1) % 2 == 0, "n must be whole blocks of ",
              kSlice, "-output slices, k even");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(few_row_linear_supports(bf16 ? "bfloat16" : x.scalar_type() == at::kFloat ? "float32" : "other"),
              "few_row_linear: this build has no kernel for ", x.scalar_type());
  for (const auto* t : {&bias, &residual})
    TORCH_CHECK(!t->has_value() || ((*t)->is_contiguous() && (*t)->scalar_type() == x.scalar_type()),
                "bias and residual: contiguous, of x's dtype");
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "bias: [n]");
  TORCH_CHECK(!residual.has_value() || (residual->dim() == 2 && residual->size(0) == x.size(0) &&
                                        residual->size(1) == n),
              "residual: [rows, n]");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  const Job job{x.size(0), n, x.size(1), block, x.element_size(), reinterpret_cast<const void*>(weight), x.data_ptr(),
                bias.has_value() ? bias->data_ptr() : nullptr,
                residual.has_value() ? residual->data_ptr() : nullptr, out.data_ptr()};
#if defined(__AVX512BF16__)
  if (bf16) {
    run<Bf16Slice>(job);
    return out;
  }
#endif
  run<Fp32Slice>(job);
  return out;
}

TORCH_LIBRARY_FRAGMENT(pdserve_kernels, m) {
  m.def("few_row_linear_supports(str dtype) -> bool", &few_row_linear_supports);
  m.def("few_row_linear(Tensor x, int weight, int n, int block, Tensor? bias, Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("few_row_linear", &few_row_linear);
}
