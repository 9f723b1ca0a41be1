// Paged attention for CPU: reads K/V where they lie in the block cache, one pass per sequence.
//
// One call covers a whole step: decode tokens and prefill chunks (with or without a cached prefix)
// side by side, described vLLM-style by query_start_loc (where each sequence's queries start in the
// flat batch) and seq_lens (each sequence's context length, this step's tokens included). Query i of
// a sequence with n queries and context L sits at position L - n + i and sees keys 0 .. L - n + i; in a
// sliding-window layer (`window` W > 0) only the last W of them, and the blocks before are not read.
//
// Work is split over (sequence, KV head, tile of queries); all query heads of one KV head are done
// together, so each K/V block is read once per group (GQA without repeating K/V). Scores go through
// an online softmax per cache block, as in flash attention. Math is fp32 whatever the cache dtype.
//
// Two paths, both written with GCC vector extensions (vec.h: 16 floats on AVX-512 and NEON, 8 on AVX2),
// so one source serves every CPU the build runs on:
// - few rows (decode: one token's query heads; few_rows.h) scores the whole context straight from the
//   cache rows, takes one exact softmax, then sums V with its accumulators in registers; it is bound
//   by memory bandwidth;
// - many rows (a prefill chunk; many_rows.h) puts query rows in the lanes of a vector and
//   broadcasts K and V elements from the cache into multiply-adds; over a bf16 cache on a CPU with
//   AVX512_BF16 it uses the native bf16 dot product. It is bound by arithmetic.
//
// An 8-bit cache (int8, fp8 e4m3 or e5m2 codes with a bf16 scale per token and KV head, kv_codes.h) is
// read by the same paths: few rows widen codes in registers and apply the scale once per token and head
// (the decode step reads half the bytes); many rows widen one block of one head at a time into scratch.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "few_rows.h"
#include "kv_codes.h"
#include "many_rows.h"
#include "vec.h"

namespace {

using namespace pdserve;

template <typename T, typename C>
void attend(const WorkItem& w, const Geometry& g, const T* q, const KVRefs<C>& kv, const int32_t* block_table,
            int64_t context_len, int64_t seq_queries, int64_t query_start, T* out, Scratch& s) {
  const int64_t first_pos = context_len - seq_queries + w.first_query;  // position of the item's first query
  if (w.num_queries * g.group <= kFewRows)
    attend_few_item<T, C>(w, g, q, kv, block_table, first_pos, query_start, out, s);
  else
    attend_many<T, C>(w, g, q, kv, block_table, first_pos, query_start, out, s);
}

// The work items dealt out to `threads` shares of about equal cost (query rows x keys they see), the
// largest first to the least loaded share. A causal prefill's tiles differ several-fold in cost, and
// an even split of the item range left one thread idle for a third of a 512-token prefill's call.
std::vector<std::vector<int32_t>> split_by_cost(const std::vector<WorkItem>& work, const Geometry& g,
                                                const int32_t* lens, const int32_t* starts, int64_t threads) {
  std::vector<int64_t> cost(work.size());
  for (size_t i = 0; i < work.size(); ++i) {
    const WorkItem& w = work[i];
    const int64_t seq_queries = starts[w.seq + 1] - starts[w.seq];
    const int64_t keys = lens[w.seq] - seq_queries + w.first_query + w.num_queries;
    cost[i] = static_cast<int64_t>(w.num_queries) * g.group * w.num_kv_heads * keys;
  }
  std::vector<int32_t> order(work.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return cost[a] > cost[b]; });
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, static_cast<int64_t>(work.size())));
  std::vector<std::vector<int32_t>> shares(threads);
  std::vector<int64_t> load(threads, 0);
  for (const int32_t i : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    shares[least].push_back(i);
    load[least] += cost[i];
  }
  return shares;
}

bool is_code_dtype(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

void check_cache(const at::Tensor& cache, const at::Tensor& like, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(cache.stride(3) == 1, name, "'s head_dim must be contiguous");
  TORCH_CHECK(cache.scalar_type() == like.scalar_type() || is_code_dtype(cache.scalar_type()), name,
              " dtype differs from the queries' and is not an 8-bit code (int8, float8_e4m3fn, float8_e5m2)");
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on the CPU");
}

// An 8-bit cache's scales: [blocks, block_size, kv_heads] bf16, beside codes of the same blocks.
void check_scales(const c10::optional<at::Tensor>& scales, const at::Tensor& codes, const char* name) {
  TORCH_CHECK(scales.has_value(), name, ": an 8-bit cache needs its scales");
  const at::Tensor& s = *scales;
  TORCH_CHECK(s.dim() == 3 && s.scalar_type() == at::kBFloat16 && s.device().is_cpu(), name,
              " must be bf16 [blocks, block_size, kv_heads] on the CPU");
  TORCH_CHECK(s.size(0) == codes.size(0) && s.size(1) == codes.size(1) && s.size(2) == codes.size(2), name,
              " must match the codes' blocks, tokens and heads");
}

// Runs fn(C{}) with C the cache's element type: the queries' T, or an 8-bit code.
template <typename T, typename Fn>
void with_cache_type(at::ScalarType cache, Fn&& fn) {
  switch (cache) {
    case at::kChar: return fn(Int8Code{});
    case at::kFloat8_e4m3fn: return fn(E4M3Code{});
    case at::kFloat8_e5m2: return fn(E5M2Code{});
    default: return fn(T{});
  }
}

}  // namespace

// out[T, heads, head_dim] = attention of q[T, heads, head_dim] over the paged cache.
// An 8-bit cache passes its codes as key_cache/value_cache and their scales.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, const c10::optional<at::Tensor>& key_scales,
                     const c10::optional<at::Tensor>& value_scales, int64_t window) {
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
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 256, "head_dim must be a multiple of 16, at most 256");
  Geometry g{q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
             heads / kv_heads, head_dim, block_size, heads * head_dim, static_cast<float>(scale), window};
  TORCH_CHECK(window >= 0, "window must be 0 (none) or the number of keys a query sees");
  const bool codes = is_code_dtype(key_cache.scalar_type());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key_cache and value_cache differ in dtype");
  if (codes) {
    check_scales(key_scales, key_cache, "key_scales");
    check_scales(value_scales, value_cache, "value_scales");
    TORCH_CHECK(key_scales->strides() == value_scales->strides(), "key_scales and value_scales must share a layout");
    g.sc_block_stride = key_scales->stride(0);
    g.sc_tok_stride = key_scales->stride(1);
    g.sc_head_stride = key_scales->stride(2);
  }
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
  const auto run = [&](auto q_zero, auto cache_zero) {
    using scalar_t = decltype(q_zero);
    using cache_t = decltype(cache_zero);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    KVRefs<cache_t> kv{static_cast<const cache_t*>(key_cache.data_ptr()),
                       static_cast<const cache_t*>(value_cache.data_ptr())};
    if (codes) {
      kv.k_scale = key_scales->data_ptr<c10::BFloat16>();
      kv.v_scale = value_scales->data_ptr<c10::BFloat16>();
    }
    scalar_t* op = out.data_ptr<scalar_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const auto shares = split_by_cost(work, g, lens, starts, at::get_num_threads());
    at::parallel_for(0, static_cast<int64_t>(shares.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t i = begin; i < end; ++i) for (const int32_t item : shares[i]) {
        const WorkItem& w = work[item];
        attend<scalar_t, cache_t>(w, g, qp, kv, tables + w.seq * max_blocks, lens[w.seq],
                                  starts[w.seq + 1] - starts[w.seq], starts[w.seq], op, scratch);
      }
    });
  };
  const auto run_q = [&](auto q_zero) {
    with_cache_type<decltype(q_zero)>(key_cache.scalar_type(), [&](auto cache_zero) { run(q_zero, cache_zero); });
  };
  switch (q.scalar_type()) {
    case at::kFloat: return run_q(float{});
    case at::kBFloat16: return run_q(c10::BFloat16{});
    case at::kHalf: return run_q(c10::Half{});
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
  TORCH_CHECK(!is_code_dtype(key_cache.scalar_type()), "an 8-bit cache is written by write_kv_codes");
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

// The 8-bit write: each token-head's row of key/value as codes and a scale (kv_codes.h), at its slot.
void write_kv_codes(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& key_scales, const at::Tensor& value_scales,
                    const at::Tensor& slots) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.sizes() == key.sizes() && value.stride(2) == 1,
              "key and value: [tokens, kv_heads, d] with contiguous d");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value differ in dtype");
  check_cache(key_cache, key, "key_cache");
  check_cache(value_cache, value, "value_cache");
  TORCH_CHECK(is_code_dtype(key_cache.scalar_type()) && key_cache.scalar_type() == value_cache.scalar_type(),
              "write_kv_codes writes int8 or float8 codes");
  check_scales(key_scales, key_cache, "key_scales");
  check_scales(value_scales, value_cache, "value_scales");
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2), "cache heads or head_dim differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.size(0) == key.size(0), "slots: int64, one per token");
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  const int64_t block_size = key_cache.size(1), num_slots = key_cache.size(0) * block_size;
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "slot ", sl[t], " is outside the cache");
  const auto run = [&](auto x_zero, auto code_zero) {
    using scalar_t = decltype(x_zero);
    using code_t = decltype(code_zero);
    const auto write = [&](const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scales) {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      auto* cp = static_cast<code_t*>(cache.data_ptr());
      auto* sp = scales.data_ptr<c10::BFloat16>();
      at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t t = i / heads, h = i % heads, block = sl[t] / block_size, pos = sl[t] % block_size;
          encode_row<code_t>(xp + t * x.stride(0) + h * x.stride(1), d,
                             cp + block * cache.stride(0) + pos * cache.stride(1) + h * cache.stride(2),
                             sp + block * scales.stride(0) + pos * scales.stride(1) + h * scales.stride(2));
        }
      });
    };
    write(key, key_cache, key_scales);
    write(value, value_cache, value_scales);
  };
  const auto run_x = [&](auto x_zero) {
    with_cache_type<decltype(x_zero)>(key_cache.scalar_type(), [&](auto code_zero) {
      if constexpr (is_code<decltype(code_zero)>()) run(x_zero, code_zero);
    });
  };
  switch (key.scalar_type()) {
    case at::kFloat: return run_x(float{});
    case at::kBFloat16: return run_x(c10::BFloat16{});
    case at::kHalf: return run_x(c10::Half{});
    default: TORCH_CHECK(false, "write_kv_codes takes float32, bfloat16 or float16 K/V, not ", key.scalar_type());
  }
}

TORCH_LIBRARY(pdserve_kernels, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, Tensor? key_scales=None, "
        "Tensor? value_scales=None, int window=0) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots) -> ()");
  m.def("write_kv_codes(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor(c!) key_scales, Tensor(d!) value_scales, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
  m.impl("write_kv_codes", &write_kv_codes);
}
