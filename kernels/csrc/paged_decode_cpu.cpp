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
// Quantized caches: see paged_cache.h. Unquantized float32/bf16 caches with the usual head shapes take the
// AVX-512 path of decode_avx512.h where the CPU has it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "decode_avx512.h"
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
                   const Scale& k_scale, const Scale& v_scale, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& rows,
                   double scale, int64_t window) {
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, row_stride = kv_heads * d, table_width = block_tables.size(1);
  const Q* qp = q.data_ptr<Q>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
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
      const int64_t offset = static_cast<int64_t>(sizeof(C)) * h0 * d, bytes = static_cast<int64_t>(sizeof(C)) * span * d;
      for_each_key(table, block_size, first, len, reinterpret_cast<const char*>(kp), row_bytes, offset, bytes,
                   [&](int64_t slot, int64_t i) {
                     for (int64_t h = h0; h < h0 + span; ++h) {
                       const C* krow = kp + slot * row_stride + h * d;
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
                       const C* vrow = vp + slot * row_stride + h * d;
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

#if defined(KVMESH_DECODE_AVX512)
// decode_kernel's tasks (a sequence's KV heads [h0, h0 + span)) on the AVX-512 path: q, the caches and out
// are all C.
template <int D, int G, typename C>
void decode_avx512(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                   const at::Tensor& rows, double scale, int64_t window) {
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), row_stride = kv_heads * D;
  const int64_t table_width = block_tables.size(1), q_stride0 = q.stride(0), o_stride0 = out.stride(0);
  const C* qp = q.data_ptr<C>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  C* op = out.data_ptr<C>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t span = rows.numel() >= 4 * at::get_num_threads() ? kv_heads : 1;
  const int64_t per_seq = kv_heads / span, tasks = rows.numel() * per_seq;
  std::vector<double> done(tasks);  // work: the keys a task walks, and a fixed cost per task
  double total = 0;
  for (const auto task : c10::irange(tasks)) {
    const int64_t len = lens[row_ids[task / per_seq]];
    done[task] = total += static_cast<double>(span) * ((window > 0 ? std::min(len, window) : len) + 16);
  }
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    const auto [begin, end] = kvmesh::share_of(done, part_begin, part_end, parts);
    std::vector<int64_t> offsets;
    std::vector<float> scores, acc(G * D);
    for (const auto task : c10::irange(begin, end)) {
      const int64_t seq = row_ids[task / per_seq], h0 = (task % per_seq) * span;
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[seq] - window) : 0, len = lens[seq] - first;
      const int32_t* table = tables + seq * table_width;
      offsets.resize((len + 15) / 16 * 16);
      int64_t i = 0;
      for (int64_t b = first / block_size; i < len; ++b) {
        const int64_t slot0 = static_cast<int64_t>(table[b]) * block_size;
        for (int64_t t = std::max(first, b * block_size); t < (b + 1) * block_size && i < len; ++t, ++i)
          offsets[i] = (slot0 + t - b * block_size) * row_stride;
      }
      std::fill(offsets.begin() + len, offsets.end(), offsets[0]);
      scores.resize(G * len);
      for (int64_t h = h0; h < h0 + span; ++h) {
        for (auto& o : offsets) o += h == h0 ? h0 * D : D;
        const C* qh = qp + starts[seq] * q_stride0 + h * G * D;
        kvmesh::avx512::attend<D, G, C>(qh, offsets.data(), kp, vp, len, static_cast<float>(scale), scores.data(),
                                        acc.data());
        C* dst = op + starts[seq] * o_stride0 + h * G * D;
        for (const auto i : c10::irange(G * D)) dst[i] = kvmesh::from_float<C>(acc[i]);
      }
    }
  });
}

template <int D, typename C>
bool try_avx512(int64_t group, at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                const at::Tensor& query_start_loc, const at::Tensor& rows, double scale, int64_t window) {
  switch (group) {
#define KVMESH_GROUP(G)                                                                                        \
  case G:                                                                                                      \
    decode_avx512<D, G, C>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows, scale, window); \
    return true;
    KVMESH_GROUP(1)
    KVMESH_GROUP(2)
    KVMESH_GROUP(3)
    KVMESH_GROUP(4)
    KVMESH_GROUP(5)
    KVMESH_GROUP(6)
    KVMESH_GROUP(7)
    KVMESH_GROUP(8)
#undef KVMESH_GROUP
    default:
      return false;
  }
}

// The AVX-512 path where it applies: an unquantized cache of q's dtype (float32 or bf16), head_dim 64 or
// 128, 1-8 query heads per KV head. False otherwise (the portable kernel serves).
bool decode_fast(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 bool scaled, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 const at::Tensor& query_start_loc, const at::Tensor& rows, double scale, int64_t window) {
  const auto dtype = q.scalar_type();
  if (scaled || k_cache.scalar_type() != dtype || (dtype != at::kFloat && dtype != at::kBFloat16)) return false;
  const int64_t d = q.size(2), group = q.size(1) / k_cache.size(2);
  auto run = [&](auto tag) {
    using C = decltype(tag);
    if (d == 64) return try_avx512<64, C>(group, out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows, scale, window);
    if (d == 128) return try_avx512<128, C>(group, out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows, scale, window);
    return false;
  };
  return dtype == at::kFloat ? run(float{}) : run(c10::BFloat16{});
}
#endif

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  const at::Tensor& rows, double scale, int64_t window) {
  kvmesh::check_paged_args("paged_decode", out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows);
  const int64_t kvh = k_cache.size(2);
  const Scale ks(k_scale, kvh), vs(v_scale, kvh);
  const auto tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const auto starts = query_start_loc.contiguous(), rows_c = rows.contiguous();
  const auto cache_type = k_cache.scalar_type();
#if defined(KVMESH_DECODE_AVX512)
  if (decode_fast(out, q, k_cache, v_cache, k_scale.has_value() || v_scale.has_value(), tables, lens, starts, rows_c,
                  scale, window))
    return;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    using Q = scalar_t;
    auto run = [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const int64_t d = q.size(2);
      if (d == 64) {
        decode_kernel<64, Q, C>(out, q, k_cache, v_cache, ks, vs, tables, lens, starts, rows_c, scale, window);
      } else if (d == 128) {
        decode_kernel<128, Q, C>(out, q, k_cache, v_cache, ks, vs, tables, lens, starts, rows_c, scale, window);
      } else {
        decode_kernel<0, Q, C>(out, q, k_cache, v_cache, ks, vs, tables, lens, starts, rows_c, scale, window);
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
