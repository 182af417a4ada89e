// What the paged attention kernels share: the scales of a quantized cache and the dispatch on its dtype.
//
// Quantized caches (kernels/quant.py) hold int8, int4 or fp8 with scales: none (the cache holds q's dtype), one
// float per KV head (fp8), one half per slot and KV head (int8) or one e4m3 byte per slot and KV head (int4's
// values). A scale is constant along head_dim, so kernels multiply a finished q.k score or a V row's weight
// by it instead of every element. An int4 cache (uint8 storage) packs two values per byte: a row of head_dim
// values is head_dim / 2 elements `Int4x2`. int4 keys carry no scale: a block's keys share a range per KV
// head and channel (`KeyRanges`), so a query is scaled per channel once per block instead.
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

inline float e4m3_to_float(uint8_t bits) {
  return static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits()));
}

// The scale of one cached row: 1, per KV head, or per slot and KV head (half, or e4m3 bytes). int4 keys'
// per-block ranges ([blocks, kv_heads, 2, head_dim]) are not a row scale: 1 here, `KeyRanges` reads them.
struct Scale {
  const float* per_head = nullptr;
  const c10::Half* per_slot = nullptr;
  const uint8_t* per_slot_e4m3 = nullptr;
  int64_t kv_heads = 1;

  explicit Scale(const std::optional<at::Tensor>& t, int64_t kvh) : kv_heads(kvh) {
    if (!t.has_value() || t->dim() == 4) return;
    if (t->dim() == 1) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == kvh, "per-head scales must be float [kv_heads]");
      per_head = t->data_ptr<float>();
    } else if (t->scalar_type() == at::kByte) {
      TORCH_CHECK(t->is_contiguous(), "per-slot e4m3 scales must be contiguous");
      per_slot_e4m3 = t->data_ptr<uint8_t>();
    } else {
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous(), "per-slot scales must be contiguous half");
      per_slot = t->data_ptr<c10::Half>();
    }
  }
  inline float at(int64_t slot, int64_t h) const {
    if (per_slot_e4m3) return e4m3_to_float(per_slot_e4m3[slot * kv_heads + h]);
    if (per_slot) return static_cast<float>(per_slot[slot * kv_heads + h]);
    return per_head ? per_head[h] : 1.f;
  }
};

// int4 keys' ranges: per block, KV head and channel, lo and hi as e4m3 bytes ([blocks, kv_heads, 2, head_dim]);
// a key is lo + step * nibble with step = (hi - lo) / 15, i.e. mid + step * (nibble - 8), mid = lo + 8 step.
struct KeyRanges {
  const uint8_t* ranges = nullptr;
  int64_t kv_heads = 1, head_dim = 0;

  explicit KeyRanges(const std::optional<at::Tensor>& t) {
    if (!t.has_value() || t->dim() != 4) return;
    TORCH_CHECK(t->scalar_type() == at::kByte && t->is_contiguous() && t->size(2) == 2,
                "int4 key ranges must be contiguous uint8 [blocks, kv_heads, 2, head_dim]");
    ranges = t->data_ptr<uint8_t>();
    kv_heads = t->size(1);
    head_dim = t->size(3);
  }
  // mid and step ([head_dim] each) of block `block`'s keys under KV head h.
  inline void get(int64_t block, int64_t h, float* mid, float* step) const {
    const uint8_t* row = ranges + (block * kv_heads + h) * 2 * head_dim;
    for (int64_t c = 0; c < head_dim; ++c) {
      const float lo = e4m3_to_float(row[c]), s = (e4m3_to_float(row[head_dim + c]) - lo) / 15.f;
      step[c] = s;
      mid[c] = lo + 8.f * s;
    }
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
