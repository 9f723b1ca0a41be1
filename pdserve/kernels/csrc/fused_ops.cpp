// The decoder's small elementwise steps fused into one pass each: RoPE applied in place to the
// q and k heads of the qkv projection's output, SwiGLU's silu(gate) * up (GeGLU's gelu_tanh(gate) * up), and RMSNorm. Unfused, each is four
// to six torch ops per layer (with fp32 round trips in bf16 models) that together cost more time
// per step than the attention itself at small batches.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "vec.h"

using namespace pdserve;

namespace {

template <typename T>
void rotate_rows(T* x, int64_t tokens, int64_t heads, int64_t tok_stride, int64_t head_dim, const int64_t* positions,
                 const float* cos, const float* sin, bool interleaved) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, 2048 / (heads * head_dim)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(head_dim), swapped(head_dim);
    const int64_t half = head_dim / 2;
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * head_dim;
      const float* s = sin + positions[t] * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* xr = x + t * tok_stride + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = widen(xr[d]);
        for (int64_t d = 0; d < head_dim; ++d)
          swapped[d] = interleaved ? row[d ^ 1] : row[d < half ? d + half : d - half];
        for (int64_t d = 0; d < head_dim; d += kLanes)
          vstore(xr + d, vload(row.data() + d) * vload(c + d) + vload(swapped.data() + d) * vload(s + d));
      }
    }
  });
}

// out = act(gate) * up per row of x = [gate | up], math in fp32.
template <typename T, typename Act>
void gated_rows(T* out, const T* x, int64_t tokens, int64_t width, int64_t x_stride, Act act) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, 8192 / width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = x + t * x_stride;
      const T* up = gate + width;
      T* o = out + t * width;
      for (int64_t i = 0; i < width; i += kLanes) vstore(o + i, act(vload(gate + i)) * vload(up + i));
    }
  });
}

// Function objects, not pointers: the call inlines into gated_rows' loop.
struct Silu {
  fvec operator()(fvec g) const { return g / (1.f + vexp(-g)); }
};

// GELU's tanh approximation, with 0.5 * (1 + tanh(z)) written as the sigmoid of 2z (the same number, SiLU's form).
struct GeluTanh {
  fvec operator()(fvec g) const {
    constexpr float k2 = 2.f * 0.7978845608028654f;  // 2 * sqrt(2 / pi)
    return g / (1.f + vexp(-(g * (1.f + 0.044715f * g * g) * k2)));
  }
};

// Rounded to T as Hugging Face's RMSNorm rounds: normalise in fp32, round, then scale by the weight.
template <typename T>
inline fvec round_to(fvec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[kLanes];
    vstore(tmp, v);
    return vload(tmp);
  }
}

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* weight, int64_t tokens, int64_t width, int64_t x_stride, float eps) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * x_stride;
      T* o = out + t * width;
      fvec sq{};
      for (int64_t i = 0; i < width; i += kLanes) {
        const fvec v = vload(xr + i);
        sq += v * v;
      }
      const float r = 1.f / std::sqrt(hsum(sq) / static_cast<float>(width) + eps);
      for (int64_t i = 0; i < width; i += kLanes)
        vstore(o + i, round_to<T>(vload(xr + i) * r) * vload(weight + i));
    }
  });
}

template <typename F>
void dispatch(at::ScalarType type, const char* what, F&& run) {
  switch (type) {
    case at::kFloat: return run(float{});
    case at::kBFloat16: return run(c10::BFloat16{});
    case at::kHalf: return run(c10::Half{});
    default: TORCH_CHECK(false, what, " takes float32, bfloat16 or float16, not ", type);
  }
}

}  // namespace

// x[T, heads, head_dim] rotated in place; cos/sin [positions, head_dim] fp32, the sign of the
// rotation folded into sin; interleaved: GPT-J pairs (x0, x1), else rotate_half's halves.
void rotary_embedding(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      bool interleaved) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x: [tokens, heads, head_dim]");
  TORCH_CHECK(x.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == x.size(2),
              "cos/sin: contiguous fp32 [positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.size(0) == x.size(0), "positions: int64 [tokens]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is past the RoPE table");
  dispatch(x.scalar_type(), "rotary_embedding", [&](auto zero) {
    using T = decltype(zero);
    rotate_rows<T>(static_cast<T*>(x.data_ptr()), x.size(0), x.size(1), x.stride(0), x.size(2), pos,
                   cos.data_ptr<float>(), sin.data_ptr<float>(), interleaved);
  });
}

// out[T, I] = act(x[:, :I]) * x[:, I:], math in fp32; x [tokens, 2 * width] (gate | up), out [tokens, width].
template <typename Act>
void gated_and_mul(const at::Tensor& out, const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 32 == 0,
              "x: [tokens, 2 * width] with width a multiple of 16");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && 2 * out.size(1) == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "out: contiguous [tokens, width] of x's dtype");
  dispatch(x.scalar_type(), what, [&](auto zero) {
    using T = decltype(zero);
    gated_rows<T>(static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), x.size(0), out.size(1),
                  x.stride(0), Act{});
  });
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) { gated_and_mul<Silu>(out, x, "silu_and_mul"); }

void gelu_tanh_and_mul(const at::Tensor& out, const at::Tensor& x) {
  gated_and_mul<GeluTanh>(out, x, "gelu_tanh_and_mul");
}

// out[T, H] = x / sqrt(mean(x^2) + eps) * weight, per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 16 == 0,
              "x: [tokens, hidden] with hidden a multiple of 16");
  TORCH_CHECK(weight.is_contiguous() && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: contiguous [hidden] of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows<T>(static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()),
                     static_cast<const T*>(weight.data_ptr()), x.size(0), x.size(1), x.stride(0),
                     static_cast<float>(eps));
  });
  return out;
}

// In place over the heads of [tokens, heads, head_dim] rows that may lie inside a wider projection output (Qwen 3's
// and Gemma 3's q and k norms, before RoPE): no copy out of the fused q|k|v matrix and back.
void rms_norm_heads(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 16 == 0,
              "x: [tokens, heads, head_dim] with contiguous head_dim, a multiple of 16");
  TORCH_CHECK(weight.is_contiguous() && weight.size(0) == x.size(2) && weight.scalar_type() == x.scalar_type(),
              "weight: contiguous [head_dim] of x's dtype");
  const int64_t heads = x.size(1), width = x.size(2), tok_stride = x.stride(0), head_stride = x.stride(1);
  dispatch(x.scalar_type(), "rms_norm_heads", [&](auto zero) {
    using T = decltype(zero);
    T* base = static_cast<T*>(x.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    at::parallel_for(0, x.size(0) * heads, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        T* row = base + (i / heads) * tok_stride + (i % heads) * head_stride;
        rms_norm_rows<T>(row, row, w, 1, width, width, static_cast<float>(eps));
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(pdserve_kernels, m) {
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, bool interleaved) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_heads(Tensor(a!) x, Tensor weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_heads", &rms_norm_heads);
}
