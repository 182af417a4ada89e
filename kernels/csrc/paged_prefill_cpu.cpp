// Paged prefill / extend attention on the CPU: each sequence's queries are its last n positions, its keys
// its whole paged context (cached prefix and the new tokens, already stored), causal, read in place.
//
// Why compiled: the torch path gathers a sequence's blocks into a contiguous copy, then runs SDPA; prefill
// attention was the largest part of a prompt's time after the linear layers. Here a task is a tile of
// kPos query positions under one KV head, with every query head of its GQA group, so each K/V row is read
// once per group. It walks key tiles of kKeys up to its last position with flash attention's online
// softmax; a key after a row's position or outside its window gets no weight. Tasks are split between
// threads by their work: a causal tile near a prompt's end has more keys than one near its start.
//
// A key tile is copied to float once, K transposed ([head_dim][kKeys]) so one row's kKeys scores are one
// vector: q.k is broadcast-multiply-adds with no horizontal sums. The inner loops use GCC/Clang vector
// types (16 floats: one AVX-512 register, two AVX2 ones), so the same code builds for any CPU.
//
// Layouts (the engine's): q/out [tokens, heads, head_dim]; k/v cache [blocks, block_size, kv_heads,
// head_dim]; block_tables [batch, max_blocks] int32; seq_lens [batch] int32; query_start_loc [batch + 1]
// int32; rows: int64 indices of the sequences to compute; window: sliding-window size (a query sees its last
// `window` positions, itself included), 0 for full attention. head_dim 64 or 128. Accumulates in float.
// Quantized caches: see paged_cache.h.
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

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

// The largest and the sum of a vector's 16 lanes, by halving (four shuffles, not fifteen dependent steps).
inline float lane_max(v16 x) {
  x = x > __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
          ? x : __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x > __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
          ? x : __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = x > __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
          ? x : __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return std::max(x[0], x[1]);
}

inline float lane_sum(v16 x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return x[0] + x[1];
}

// exp of 16 floats at once: 2^n (exponent bits) times a degree-6 polynomial of the remainder in
// [-ln2/2, ln2/2] (relative error under 2e-7). Inputs below -87 give about 1e-38, not 0; callers mask.
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.f, hi = v16{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v16 t = x * 1.44269504f;
  const i16 n = __builtin_convertvector(t + (t >= 0 ? v16{} + 0.5f : v16{} - 0.5f), i16);
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = x - nf * 0.693145752f - nf * 1.42860677e-6f;
  v16 p = 1.f / 720 + r * (1.f / 5040);
  p = 1.f / 120 + r * p;
  p = 1.f / 24 + r * p;
  p = 1.f / 6 + r * p;
  p = 0.5f + r * p;
  p = 1.f + r * p;
  p = 1.f + r * p;
  return p * reinterpret_cast<v16>((n + 127) << 23);
}

constexpr int64_t kKeys = 16;  // keys per tile: a query row's scores are one v16
constexpr int64_t kPos = 16;   // query positions per task
constexpr int64_t kRows = 8;   // query rows per q.k micro-kernel call (independent accumulators)
const i16 kLane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

struct Task {
  int64_t seq, head, first;  // sequence, KV head, first query of the tile (0-based within the sequence)
};

// s[r] = the scores of query rows [0, kRows) against the tile's keys; kt is [D][kKeys].
template <int64_t D>
inline void tile_scores(const float* q, const v16* kt, v16* s) {
  v16 acc[kRows] = {};
  for (int64_t d = 0; d < D; ++d) {
    const v16 k = kt[d];
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRows; ++r) acc[r] += q[r * D + d] * k;
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < kRows; ++r) s[r] = acc[r];
}

// o[r] = o[r] * corr[r] + sum_i p[r][i] v[i] for the RB rows starting at o; v is [kKeys][D / 16].
template <int64_t D, int64_t RB>
inline void tile_values(v16* o, const v16* p, const float* corr, const v16* v, int64_t keys) {
  constexpr int64_t C = D / 16;
  v16 acc[RB][C];
#pragma GCC unroll 8
  for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) acc[r][c] = o[r * C + c] * corr[r];
  for (int64_t i = 0; i < keys; ++i) {
#pragma GCC unroll 8
    for (int64_t r = 0; r < RB; ++r) {
      const float w = p[r][i];
#pragma GCC unroll 8
      for (int64_t c = 0; c < C; ++c) acc[r][c] += w * v[i * C + c];
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) o[r * C + c] = acc[r][c];
}

template <int64_t D, typename Q, typename C>
void prefill_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const Scale& k_scale, const Scale& v_scale, const kvmesh::KeyRanges& ranges,
                    const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& rows,
                    double scale, int64_t window) {
  constexpr int64_t VC = D / 16;                 // v16 vectors per head_dim row
  constexpr int64_t RB = VC >= 8 ? 2 : 16 / VC;  // rows per weighted-sum call: 16 accumulators
  const int64_t heads = q.size(1), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  constexpr int64_t P = kvmesh::kPacked<C>;  // values per cache element
  const int64_t group = heads / kv_heads, row_stride = kv_heads * D / P, table_width = block_tables.size(1);
  const Q* qp = q.data_ptr<Q>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  Q* op = out.data_ptr<Q>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t q_stride0 = q.stride(0), o_stride0 = out.stride(0);

  // The first key a query at `pos` sees, and the tasks with their work (query rows x keys walked).
  auto first_key = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; };
  std::vector<Task> tasks;
  std::vector<double> done;  // work of the tasks up to and including each
  double total = 0;
  for (const auto r : c10::irange(rows.numel())) {
    const int64_t seq = row_ids[r], n = starts[seq + 1] - starts[seq], len = lens[seq];
    for (int64_t j = 0; j < n; j += kPos) {
      const int64_t pos0 = len - n + j, last = len - n + std::min(n, j + kPos) - 1;
      const double work = static_cast<double>(std::min(n - j, kPos)) * (last + 1 - first_key(pos0));
      for (const auto h : c10::irange(kv_heads)) {
        tasks.push_back({seq, h, j});
        done.push_back(total += work);
      }
    }
  }
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  if (parts == 0) return;
  const int64_t max_rows = (kPos * group + kRows - 1) / kRows * kRows;

  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> qf(max_rows * D), m(max_rows), l(max_rows), corr(max_rows);
    std::vector<v16> kt(D), vt(kKeys * VC), s(max_rows), o(max_rows * VC);
    std::vector<float> mid(D), step(D);  // int4 keys: the ranges of the block last read
    int64_t current = -1;
    // This thread's tasks: those whose work ends in its share of the total.
    const auto lo = std::lower_bound(done.begin(), done.end(), total * part_begin / parts - 1e-9) - done.begin();
    const auto hi = part_end == parts ? static_cast<int64_t>(tasks.size())
                                      : std::lower_bound(done.begin(), done.end(), total * part_end / parts - 1e-9) -
                                            done.begin();
    for (int64_t t = lo; t < hi; ++t) {
      const auto [seq, h, j] = tasks[t];
      const int64_t n = starts[seq + 1] - starts[seq], len = lens[seq];
      const int64_t npos = std::min(n - j, kPos), pos0 = len - n + j, nrows = npos * group;
      const int64_t prows = (nrows + kRows - 1) / kRows * kRows;
      const int32_t* table = tables + seq * table_width;
      // Query row r is position pos0 + r / group, query head h * group + r % group; padding rows are zero.
      std::fill(qf.begin(), qf.begin() + prows * D, 0.f);
      for (const auto r : c10::irange(nrows)) {
        const Q* src = qp + (starts[seq] + j + r / group) * q_stride0 + (h * group + r % group) * D;
        for (const auto i : c10::irange(D)) qf[r * D + i] = kvmesh::to_float(src[i]) * static_cast<float>(scale);
      }
      std::fill(o.begin(), o.begin() + prows * VC, v16{});
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(m.begin(), m.end(), 0.f);
      std::fill(corr.begin(), corr.end(), 1.f);
      const int64_t key_end = pos0 + npos;
      current = -1;
      for (int64_t k0 = first_key(pos0); k0 < key_end; k0 += kKeys) {
        const int64_t nk = std::min(kKeys, key_end - k0);
        for (const auto i : c10::irange(kKeys)) {
          if (i >= nk) {
            for (const auto d : c10::irange(D)) kt[d][i] = 0.f;
            for (const auto c : c10::irange(VC)) vt[i * VC + c] = v16{};
            continue;
          }
          const int64_t key = k0 + i, slot = table[key / block_size] * static_cast<int64_t>(block_size) + key % block_size;
          const C* krow = kp + slot * row_stride + h * D / P;
          const C* vrow = vp + slot * row_stride + h * D / P;
          const float ks = k_scale.at(slot, h), vs = v_scale.at(slot, h);
          if constexpr (P == 2) {  // int4 keys: mid + step * level per channel, per block
            const int64_t block = table[key / block_size];
            if (block != current) {
              current = block;
              ranges.get(block, h, mid.data(), step.data());
            }
            for (const auto d : c10::irange(D)) kt[d][i] = mid[d] + step[d] * kvmesh::load(krow, d);
          } else {
            for (const auto d : c10::irange(D)) kt[d][i] = ks * kvmesh::load(krow, d);
          }
          float* vf = reinterpret_cast<float*>(vt.data() + i * VC);
          for (const auto d : c10::irange(D)) vf[d] = vs * kvmesh::load(vrow, d);
        }
        for (int64_t r = 0; r < prows; r += kRows) tile_scores<D>(qf.data() + r * D, kt.data(), s.data() + r);
        // Online softmax: row r weighs the tile's keys [a, b) it may see; m, l: its running max and sum.
        for (int64_t r = 0; r < prows; ++r) {
          const int64_t pos = pos0 + r / group;
          const int64_t a = std::max<int64_t>(first_key(pos) - k0, 0), b = std::min<int64_t>(pos + 1 - k0, nk);
          if (r >= nrows || a >= b) {
            s[r] = v16{};
            corr[r] = 1.f;
            continue;
          }
          const i16 seen = (kLane >= static_cast<int32_t>(a)) & (kLane < static_cast<int32_t>(b));
          const v16 x = seen ? s[r] : v16{} - 1e30f;
          const float top = lane_max(x);
          const bool first = l[r] == 0.f;
          const float mx = first ? top : std::max(m[r], top);
          corr[r] = first ? 0.f : mx == m[r] ? 1.f : std::exp(m[r] - mx);
          m[r] = mx;
          s[r] = seen ? exp16(x - mx) : v16{};
          const float sum = lane_sum(s[r]);
          l[r] = l[r] * corr[r] + sum;
        }
        for (int64_t r = 0; r < prows; r += RB) {
          tile_values<D, RB>(o.data() + r * VC, s.data() + r, corr.data() + r, vt.data(), nk);
        }
      }
      for (const auto r : c10::irange(nrows)) {
        Q* dst = op + (starts[seq] + j + r / group) * o_stride0 + (h * group + r % group) * D;
        const float* src = reinterpret_cast<const float*>(o.data() + r * VC);
        const float inv = 1.f / l[r];
        for (const auto i : c10::irange(D)) dst[i] = kvmesh::from_float<Q>(src[i] * inv);
      }
    }
  });
}

void paged_prefill(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                   const at::Tensor& rows, double scale, int64_t window) {
  kvmesh::check_paged_args("paged_prefill", out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, rows);
  const int64_t kvh = k_cache.size(2), d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "paged_prefill takes head_dim 64 or 128, got ", d);
  const Scale ks(k_scale, kvh), vs(v_scale, kvh);
  const kvmesh::KeyRanges kr(k_scale);
  TORCH_CHECK((k_cache.scalar_type() == at::kByte) == (kr.ranges != nullptr), "int4 keys need their block ranges");
  const auto tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const auto starts = query_start_loc.contiguous(), rows_c = rows.contiguous();
  auto for_q = [&](auto q_tag) {
    using Q = decltype(q_tag);
    auto run = [&](auto cache_tag) {
      using C = decltype(cache_tag);
      if (d == 64) {
        prefill_kernel<64, Q, C>(out, q, k_cache, v_cache, ks, vs, kr, tables, lens, starts, rows_c, scale, window);
      } else {
        prefill_kernel<128, Q, C>(out, q, k_cache, v_cache, ks, vs, kr, tables, lens, starts, rows_c, scale, window);
      }
    };
    kvmesh::with_cache_type<Q>(k_cache.scalar_type(), q.scalar_type(), run);
  };
  switch (q.scalar_type()) {  // the types it computes in float (not double: the torch path serves that)
    case at::kFloat:
      for_q(float{});
      break;
    case at::kHalf:
      for_q(c10::Half{});
      break;
    case at::kBFloat16:
      for_q(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "paged_prefill takes float32, float16 or bfloat16 q, got ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("paged_prefill(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, "
        "Tensor? v_scale, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor rows, "
        "float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
