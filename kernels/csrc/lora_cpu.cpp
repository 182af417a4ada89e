// A batch's LoRA updates in one call per projection, each token through its own adapter (segmented, as vLLM's
// punica and S-LoRA's SGMV do on GPUs).
//
// lora_update(y, x, a, b, rows, seg, bounds):
//   the tokens rows[seg[i]:seg[i+1]] use adapter i, whose a[i] is [slices * r, in] (each output slice's A,
//   stacked) and b[i] is [r, out] (each slice's B, scaled, transposed, side by side: slice s owns output
//   columns bounds[s]:bounds[s+1] and rank rows s*r:(s+1)*r of the shrink). For each such token t:
//     y[t, bounds[s]:bounds[s+1]] += (a[i][s*r:(s+1)*r] @ x[t]) @ b[i][:, bounds[s]:bounds[s+1]]
//   An adapter without this projection has empty a[i] and b[i] and its tokens are left alone.
//
// Why compiled: in torch each adapter is, per projection, a gather, a matmul per part and a scatter-add, a
// dozen small ops per adapter and layer. Here a tile of one adapter's tokens reads each A and B row once for
// all its tokens, with the partial sums in registers, computes in float and rounds once into y; tiles are
// shared out between threads, each token's row of y written by one thread only.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"

namespace {

using kvmesh::from_float;
using kvmesh::to_float;

constexpr int64_t kTile = 8;   // tokens of one adapter computed together (padded: rows past n repeat row 0)
constexpr int64_t kLanes = 8;  // columns per register block: one AVX2 vector of floats

struct Tile {
  int64_t adapter, begin, end;  // positions in rows
};

typedef float f8 __attribute__((vector_size(kLanes * sizeof(float))));

template <typename T>
inline f8 load8(const T* p) {
  f8 v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof v);
  } else {
    for (int u = 0; u < kLanes; ++u) v[u] = to_float(p[u]);
  }
  return v;
}

inline float hsum(f8 v) {
  float sum = 0.f;
  for (int u = 0; u < kLanes; ++u) sum += v[u];
  return sum;
}

// shrink[t][q] = a[q] . x[rows[t]] for every A row q: each 8 columns of a row loaded once for all the tile's
// tokens, kTile partial sums held in vector registers.
template <int64_t N, typename T>
void shrink_tile(const T* a, const T* const* xt, int64_t in, int64_t width, float* shrink) {
  for (const auto q : c10::irange(width)) {
    const T* arow = a + q * in;
    f8 acc[N] = {};
    int64_t k = 0;
    for (; k + kLanes <= in; k += kLanes) {
      const f8 av = load8(arow + k);
#pragma GCC unroll 8
      for (int64_t t = 0; t < N; ++t) acc[t] += av * load8(xt[t] + k);
    }
    for (const auto t : c10::irange(N)) {
      float sum = hsum(acc[t]);
      for (int64_t kk = k; kk < in; ++kk) sum += to_float(arow[kk]) * to_float(xt[t][kk]);
      shrink[t * width + q] = sum;
    }
  }
}

// y[rows[t], lo:hi] += shrink[t, part rows] @ b[:, lo:hi] for each part: 8 columns of every B row loaded once
// for all the tile's tokens, summed in vector registers and added to y once (one rounding).
template <int64_t N, typename T>
void expand_tile(const T* b, const float* shrink, T* const* yt, int64_t n, int64_t out, int64_t r, int64_t width,
                 const std::vector<int64_t>& bounds) {
  for (const auto s : c10::irange(static_cast<int64_t>(bounds.size()) - 1)) {
    const float* sh = shrink + s * r;
    const int64_t lo = bounds[s], hi = bounds[s + 1];
    int64_t o = lo;
    for (; o + kLanes <= hi; o += kLanes) {
      f8 acc[N] = {};
      for (const auto j : c10::irange(r)) {
        const f8 bv = load8(b + j * out + o);
#pragma GCC unroll 8
        for (int64_t t = 0; t < N; ++t) acc[t] += sh[t * width + j] * bv;
      }
      for (const auto t : c10::irange(n)) {
        for (const auto u : c10::irange(kLanes)) yt[t][o + u] = from_float<T>(to_float(yt[t][o + u]) + acc[t][u]);
      }
    }
    for (; o < hi; ++o) {
      for (const auto t : c10::irange(n)) {
        float sum = 0.f;
        for (const auto j : c10::irange(r)) sum += sh[t * width + j] * to_float(b[j * out + o]);
        yt[t][o] = from_float<T>(to_float(yt[t][o]) + sum);
      }
    }
  }
}

template <typename T>
void update_tile(const T* a, const T* b, const T* x, int64_t xs, T* y, int64_t ys, const int64_t* rows, int64_t n,
                 int64_t in, int64_t out, int64_t r, const std::vector<int64_t>& bounds, float* shrink) {
  const T* xt[kTile];
  T* yt[kTile];
  for (const auto t : c10::irange(kTile)) {
    xt[t] = x + rows[t < n ? t : 0] * xs;
    yt[t] = y + rows[t < n ? t : 0] * ys;
  }
  const int64_t width = (static_cast<int64_t>(bounds.size()) - 1) * r;
  // Tiles of a power of two tokens, so that an adapter with one token this step computes one, not kTile.
  if (n == 1) {
    shrink_tile<1>(a, xt, in, width, shrink);
    expand_tile<1>(b, shrink, yt, n, out, r, width, bounds);
  } else if (n == 2) {
    shrink_tile<2>(a, xt, in, width, shrink);
    expand_tile<2>(b, shrink, yt, n, out, r, width, bounds);
  } else if (n <= 4) {
    shrink_tile<4>(a, xt, in, width, shrink);
    expand_tile<4>(b, shrink, yt, n, out, r, width, bounds);
  } else {
    shrink_tile<kTile>(a, xt, in, width, shrink);
    expand_tile<kTile>(b, shrink, yt, n, out, r, width, bounds);
  }
}

void lora_update(at::Tensor y, const at::Tensor& x, at::TensorList a, at::TensorList b, const at::Tensor& rows,
                 const at::Tensor& seg, at::IntArrayRef bounds) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, in] on the CPU");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.scalar_type() == x.scalar_type(),
              "y must be [tokens, out] of x's dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be contiguous int64");
  TORCH_CHECK(seg.scalar_type() == at::kLong && seg.is_contiguous() && seg.numel() == static_cast<int64_t>(a.size()) + 1,
              "seg must be int64 [adapters + 1]");
  TORCH_CHECK(a.size() == b.size() && bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == y.size(1) &&
                  std::is_sorted(bounds.begin(), bounds.end()),
              "one b per a, and bounds from 0 to y's width");
  const int64_t in = x.size(1), out = y.size(1), slices = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = seg.data_ptr<int64_t>();
  std::vector<int64_t> cuts(bounds.begin(), bounds.end());
  std::vector<Tile> tiles;
  int64_t widest = 0;
  for (const auto i : c10::irange(static_cast<int64_t>(a.size()))) {
    if (a[i].numel() == 0) continue;
    const int64_t r = b[i].size(0);
    TORCH_CHECK(a[i].is_contiguous() && b[i].is_contiguous() && a[i].scalar_type() == x.scalar_type() &&
                    b[i].scalar_type() == x.scalar_type(),
                "adapter weights must be contiguous, of x's dtype");
    TORCH_CHECK(a[i].dim() == 2 && a[i].size(0) == slices * r && a[i].size(1) == in && b[i].dim() == 2 &&
                    b[i].size(1) == out,
                "adapter ", i, ": a must be [slices * r, in] and b [r, out]");
    TORCH_CHECK(0 <= sp[i] && sp[i] <= sp[i + 1] && sp[i + 1] <= rows.numel(), "seg must be ascending within rows");
    widest = std::max(widest, slices * r);
    for (int64_t t = sp[i]; t < sp[i + 1]; t += kTile) tiles.push_back({i, t, std::min(t + kTile, sp[i + 1])});
  }
  for (const auto t : c10::irange(rows.numel())) {
    TORCH_CHECK(rp[t] >= 0 && rp[t] < x.size(0), "row ", rp[t], " is outside the batch");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_update", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> shrink(kTile * widest);
      for (const auto k : c10::irange(begin, end)) {
        const Tile& tile = tiles[k];
        const at::Tensor &ai = a[tile.adapter], &bi = b[tile.adapter];
        update_tile(ai.data_ptr<scalar_t>(), bi.data_ptr<scalar_t>(), xp, x.stride(0), yp, y.stride(0),
                    rp + tile.begin, tile.end - tile.begin, in, out, bi.size(0), cuts, shrink.data());
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("lora_update(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, Tensor rows, Tensor seg, int[] bounds) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) { m.impl("lora_update", &lora_update); }
