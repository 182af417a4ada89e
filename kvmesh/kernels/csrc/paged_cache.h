// What the paged attention kernels share: the scales of a quantized cache and the dispatch on its dtype.
//
// Quantized caches (kernels/quant.py) hold int8, int4 or fp8 with scales: none (the cache holds q's dtype), one
// float per KV head (fp8), or one half per slot and KV head (int8, int4). A scale is constant along head_dim,
// so kernels multiply a finished q.k score or a V row's weight by it instead of every element. An int4 cache
// (uint8 storage) packs two values per byte: a row of head_dim values is head_dim / 2 elements `Int4x2`.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <optional>

#include "convert.h"

namespace kvmesh {

// Two int4 values: element 2i in the low nibble, 2i + 1 in the high one, each stored as value + 8.
struct Int4x2 {
  uint8_t bits;
};

// Values per cache element: 2 for packed int4, else 1.
template <typename C>
constexpr int64_t kPacked = 1;
template <>
constexpr int64_t kPacked<Int4x2> = 2;

// Value i of a cached row starting at `row`, as a float (before its scale).
template <typename C>
inline float load(const C* row, int64_t i) {
  return to_float(row[i]);
}
inline float load(const Int4x2* row, int64_t i) {
  const uint8_t b = row[i >> 1].bits;
  return static_cast<float>(static_cast<int>((i & 1) ? (b >> 4) : (b & 15)) - 8);
}

// The scale of one cached row: 1, per KV head, or per slot and KV head.
struct Scale {
  const float* per_head = nullptr;
  const c10::Half* per_slot = nullptr;
  int64_t kv_heads = 1;

  explicit Scale(const std::optional<at::Tensor>& t, int64_t kvh) : kv_heads(kvh) {
    if (!t.has_value()) return;
    if (t->dim() == 1) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == kvh, "per-head scales must be float [kv_heads]");
      per_head = t->data_ptr<float>();
    } else {
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous(), "per-slot scales must be contiguous half");
      per_slot = t->data_ptr<c10::Half>();
    }
  }
  inline float at(int64_t slot, int64_t h) const {
    if (per_slot) return static_cast<float>(per_slot[slot * kv_heads + h]);
    return per_head ? per_head[h] : 1.f;
  }
};

// The layouts both paged kernels take (their callers: kernels/torch_attention.py); `name` heads the errors.
inline void check_paged_args(const char* name, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, const at::Tensor& rows) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), name, " is a CPU kernel");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.stride(2) == 1 && out.stride(2) == 1 &&
                  q.stride(1) == q.size(2) && out.stride(1) == out.size(2),
              "q/out must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k/v caches must be contiguous [blocks, block_size, kv_heads, head_dim] of one dtype");
  const int64_t packed = k_cache.scalar_type() == at::kByte ? 2 : 1;  // int4: two values per byte
  TORCH_CHECK(q.size(2) == packed * k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && rows.scalar_type() == at::kLong,
              "block_tables/seq_lens/query_start_loc must be int32 and rows int64");
}

// Calls f(C{}) with C the cache's element type: q's own (Q), int8, packed int4, or one of the fp8 formats.
template <typename Q, typename F>
void with_cache_type(at::ScalarType cache, at::ScalarType q, F&& f) {
  if (cache == q) {
    f(Q{});
  } else if (cache == at::kChar) {
    f(int8_t{});
  } else if (cache == at::kByte) {
    f(Int4x2{});
  } else if (cache == at::kFloat8_e4m3fn) {
    f(c10::Float8_e4m3fn{});
  } else if (cache == at::kFloat8_e5m2) {
    f(c10::Float8_e5m2{});
  } else {
    TORCH_CHECK(false, "cache dtype ", cache, " does not match q's ", q, " nor int8/int4/fp8");
  }
}

}  // namespace kvmesh
