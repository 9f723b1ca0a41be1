// What the paged-attention paths share: a work item, the call's geometry, per-thread scratch memory.
#pragma once

#include <cstdint>
#include <vector>

#include <c10/util/BFloat16.h>

#include "vec.h"

namespace pdserve {

constexpr int64_t kRowsPerTile = 192;  // query rows (tokens x heads of one group) per work item
constexpr int64_t kFewRows = 8;        // tiles up to this many rows read the cache directly

struct WorkItem {
  int32_t seq;
  int32_t kv_head;       // the first of num_kv_heads (more than one only on the few-rows path)
  int32_t num_kv_heads;
  int32_t first_query;   // within the sequence
  int32_t num_queries;
};

struct Geometry {  // what every work item of one call shares
  int64_t q_tok_stride, q_head_stride, kv_block_stride, kv_tok_stride, kv_head_stride;
  int64_t group, head_dim, block_size, out_tok_stride;
  float scale;
  int64_t window = 0;  // a sliding-window layer's: a query sees only the last `window` keys, itself included
  // An 8-bit cache's scales ([blocks, block_size, kv_heads] per K and V, in bf16 elements); unused otherwise.
  int64_t sc_block_stride = 0, sc_tok_stride = 0, sc_head_stride = 0;
};

// Where one call's K and V are: the cache's elements (C: the model's dtype, or an 8-bit code) and, for
// codes, their scales.
template <typename C>
struct KVRefs {
  const C* k;
  const C* v;
  const c10::BFloat16* k_scale = nullptr;
  const c10::BFloat16* v_scale = nullptr;
};

// One thread's working memory, reused across its work items (vectors only grow).
struct Scratch {
  std::vector<float> q, acc, scores, row_sum;
  std::vector<int64_t> offsets;      // few rows: each token's offset into the cache
  std::vector<int64_t> scale_offsets;  // few rows over 8-bit codes: each token's offset into the scales
  std::vector<float> kscale, vscale;  // few rows over 8-bit codes: the scales, [head][token]
  bool codes_on_bf16 = false;        // few rows: 8-bit codes meet s.q_bf16 and the weights on bf16 dot products
  std::vector<float> kbuf, vbuf;     // many rows over 8-bit codes: one block of one head, widened
  std::vector<fvec> dots;          // few rows: partial dot products, kLanes tokens per row
  std::vector<uint16_t> q_bf16;      // few rows: the bf16 query
  std::vector<uint32_t> qp, pp, vp;  // many rows, native bf16: query, weight and V pairs
  std::vector<float> m, l;           // many rows: running max and sum, kLanes rows per vector
};

}  // namespace pdserve
