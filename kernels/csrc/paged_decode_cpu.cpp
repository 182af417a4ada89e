// Paged decode attention on the CPU, reading K/V straight out of the paged cache.
//
// Why a compiled kernel: in torch, attention over scattered blocks must first gather them into a contiguous
// tensor, which copies every cached K and V byte once more than attention itself reads them; on a CPU that
// copy costs as much as the attention. Here each (sequence, KV head) task walks its block table and reads
// each cached row once: scores for the whole GQA group, an exact softmax, then the weighted sum of V.
//
// Layouts (the engine's): q/out [tokens, heads, head_dim]; k/v cache [blocks, block_size, kv_heads,
// head_dim]; block_tables [batch, max_blocks] int32; seq_lens [batch] int32; query_start_loc [batch + 1]
// int32; rows: int64 indices of the decode sequences (query length 1) to compute; window: sliding-window
// size (the query sees its last `window` positions, itself included), 0 for full attention. Accumulates in
// float.
//
// Quantized caches: see paged_cache.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "paged_cache.h"

namespace {

using kvmesh::Scale;

// D: head_dim when known at compile time (64, 128: fully unrolled vector code), 0 for any. Plain loops:
// -O3 -ffast-math vectorizes them with register accumulators (an omp simd reduction spills to the stack).
template <int64_t D, typename C>
inline float dot(const float* q, const C* k, int64_t d) {
  const int64_t n = D ? D : d;
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += q[i] * kvmesh::to_float(k[i]);
  return acc;
}

template <int64_t D, typename C>
inline void axpy(float w, const C* v, float* acc, int64_t d) {
  const int64_t n = D ? D : d;
  for (int64_t i = 0; i < n; ++i) acc[i] += w * kvmesh::to_float(v[i]);
}

// Packed int4 rows: each byte is two values (paged_cache.h).
template <int64_t D>
inline float dot(const float* q, const kvmesh::Int4x2* k, int64_t d) {
  const int64_t n = (D ? D : d) / 2;
  float even = 0.f, odd = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t b = k[i].bits;
    even += q[2 * i] * static_cast<float>(static_cast<int>(b & 15) - 8);
    odd += q[2 * i + 1] * static_cast<float>(static_cast<int>(b >> 4) - 8);
  }
  return even + odd;
}

template <int64_t D>
inline void axpy(float w, const kvmesh::Int4x2* v, float* acc, int64_t d) {
  const int64_t n = (D ? D : d) / 2;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t b = v[i].bits;
    acc[2 * i] += w * static_cast<float>(static_cast<int>(b & 15) - 8);
    acc[2 * i + 1] += w * static_cast<float>(static_cast<int>(b >> 4) - 8);
  }
}

// Calls f(slot, i) for the keys [first, first + len) of a sequence, block by block (no division per key).
// While a block's row r is read, row r of the next block is prefetched (its bytes [row_offset, row_offset +
// row_bytes)): blocks are scattered, so the hardware prefetcher cannot guess the next one.
template <typename F>
inline void for_each_key(const int32_t* table, int64_t block_size, int64_t first, int64_t len, const char* base,
                         int64_t row_stride_bytes, int64_t row_offset, int64_t row_bytes, F&& f) {
  const int64_t end = first + len;
  int64_t i = 0;
  for (int64_t b = first / block_size; b * block_size < end; ++b) {
    const bool more = (b + 1) * block_size < end;
    const char* next = base + (more ? static_cast<int64_t>(table[b + 1]) : 0) * block_size * row_stride_bytes +
                       row_offset;
    const int64_t slot0 = static_cast<int64_t>(table[b]) * block_size;
    const int64_t t0 = std::max(first, b * block_size), t1 = std::min(end, (b + 1) * block_size);
    for (int64_t t = t0; t < t1; ++t, ++i) {
      if (more) {
        const char* row = next + (t - b * block_size) * row_stride_bytes;
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off);
      }
      f(slot0 + t - b * block_size, i);
    }
  }
}

template <int64_t D, typename Q, typename C>
void decode_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const Scale& k_scale, const Scale& v_scale, const kvmesh::KeyRanges& ranges,
                   const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& rows,
                   double scale, int64_t window) {
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  constexpr int64_t P = kvmesh::kPacked<C>;  // values per cache element
  const int64_t group = heads / kv_heads, row_stride = kv_heads * d / P, table_width = block_tables.size(1);
  const Q* qp = q.data_ptr<Q>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  Q* op = out.data_ptr<Q>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t q_stride0 = q.stride(0), o_stride0 = out.stride(0);
  // A task is a sequence's KV heads [h0, h0 + span): all of them when there are sequences enough to keep
  // every thread busy (a block's rows are then read front to back), one each otherwise.
  const int64_t span = rows.numel() >= 4 * at::get_num_threads() ? kv_heads : 1;
  const int64_t per_seq = kv_heads / span, tasks = rows.numel() * per_seq;
  const int64_t row_bytes = static_cast<int64_t>(sizeof(C)) * row_stride;

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = span * group;  // query heads of a task
    std::vector<float> qf(width * d), acc(width * d), scores;
    // int4 keys: per block, q scaled by the block's steps (qs) and q . mid (bias), for each query row.
    std::vector<float> qs(width * d), bias(width), mid(d), step(d);
    std::vector<int64_t> current(span);
    for (const auto task : c10::irange(begin, end)) {
      const int64_t seq = row_ids[task / per_seq], h0 = (task % per_seq) * span;
      const int64_t token = starts[seq], first = window > 0 ? std::max<int64_t>(0, lens[seq] - window) : 0;
      const int64_t len = lens[seq] - first;  // keys [first, first + len): scores[w * len + (t - first)]
      const int32_t* table = tables + seq * table_width;
      for (const auto w : c10::irange(width)) {
        const Q* src = qp + token * q_stride0 + (h0 * group + w) * d;
        for (const auto i : c10::irange(d)) qf[w * d + i] = kvmesh::to_float(src[i]) * static_cast<float>(scale);
      }
      scores.resize(width * len);
      const int64_t offset = static_cast<int64_t>(sizeof(C)) * h0 * d / P;
      const int64_t bytes = static_cast<int64_t>(sizeof(C)) * span * d / P;
      std::fill(current.begin(), current.end(), -1);
      for_each_key(table, block_size, first, len, reinterpret_cast<const char*>(kp), row_bytes, offset, bytes,
                   [&](int64_t slot, int64_t i) {
                     for (int64_t h = h0; h < h0 + span; ++h) {
                       const C* krow = kp + slot * row_stride + h * d / P;
                       if constexpr (P == 2) {  // int4 keys: mid + step * level per channel, per block
                         const int64_t block = slot / block_size;
                         if (block != current[h - h0]) {
                           current[h - h0] = block;
                           ranges.get(block, h, mid.data(), step.data());
                           for (const auto g : c10::irange(group)) {
                             const int64_t w = (h - h0) * group + g;
                             float b = 0.f;
                             for (const auto c : c10::irange(d)) {
                               qs[w * d + c] = qf[w * d + c] * step[c];
                               b += qf[w * d + c] * mid[c];
                             }
                             bias[w] = b;
                           }
                         }
                         for (const auto g : c10::irange(group)) {
                           const int64_t w = (h - h0) * group + g;
                           scores[w * len + i] = bias[w] + dot<D>(qs.data() + w * d, krow, d);
                         }
                         continue;
                       }
                       const float ks = k_scale.at(slot, h);
                       for (const auto g : c10::irange(group)) {
                         const int64_t w = (h - h0) * group + g;
                         scores[w * len + i] = ks * dot<D>(qf.data() + w * d, krow, d);
                       }
                     }
                   });
      for (const auto w : c10::irange(width)) {
        float* s = scores.data() + w * len;
        const float m = *std::max_element(s, s + len);
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] = std::exp(s[t] - m);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) total += s[t];
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_key(table, block_size, first, len, reinterpret_cast<const char*>(vp), row_bytes, offset, bytes,
                   [&](int64_t slot, int64_t i) {
                     for (int64_t h = h0; h < h0 + span; ++h) {
                       const C* vrow = vp + slot * row_stride + h * d / P;
                       const float vs = v_scale.at(slot, h);
                       for (const auto g : c10::irange(group)) {
                         const int64_t w = (h - h0) * group + g;
                         axpy<D>(vs * scores[w * len + i], vrow, acc.data() + w * d, d);
                       }
                     }
                   });
      for (const auto w : c10::irange(width)) {
        Q* dst = op + token * o_stride0 + (h0 * group + w) * d;
        for (const auto i : c10::irange(d)) dst[i] = kvmesh::from_float<Q>(acc[w * d + i]);
      }
    }
  });
}

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  const at::Tensor& rows, double scale, int64_t window) {
  kvmesh::check_paged_args("paged_decode", out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows);
  const int64_t kvh = k_cache.size(2);
  const Scale ks(k_scale, kvh), vs(v_scale, kvh);
  const kvmesh::KeyRanges kr(k_scale);
  TORCH_CHECK((k_cache.scalar_type() == at::kByte) == (kr.ranges != nullptr), "int4 keys need their block ranges");
  const auto tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const auto starts = query_start_loc.contiguous(), rows_c = rows.contiguous();
  const auto cache_type = k_cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    using Q = scalar_t;
    auto run = [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const int64_t d = q.size(2);
      if (d == 64) {
        decode_kernel<64, Q, C>(out, q, k_cache, v_cache, ks, vs, kr, tables, lens, starts, rows_c, scale, window);
      } else if (d == 128) {
        decode_kernel<128, Q, C>(out, q, k_cache, v_cache, ks, vs, kr, tables, lens, starts, rows_c, scale, window);
      } else {
        decode_kernel<0, Q, C>(out, q, k_cache, v_cache, ks, vs, kr, tables, lens, starts, rows_c, scale, window);
      }
    };
    kvmesh::with_cache_type<Q>(cache_type, q.scalar_type(), run);
  });
}

}  // namespace

TORCH_LIBRARY(kvmesh_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, "
        "Tensor? v_scale, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor rows, "
        "float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
