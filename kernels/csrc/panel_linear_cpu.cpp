// A float32 linear layer for decode-sized batches, on a weight packed in panels of 32 output columns, with the
// next panel prefetched while the current one computes.
//
// Why: a decode step reads every weight of the model once, more than stays in the caches between steps, so
// each step streams them from memory; oneDNN's GEMM leaves that stream unhidden (SmolLM2's float32 decode
// step took 1.3-1.6x longer on each layer's own weights than on one layer's reused: benchmarks/cpu_linear.py
// --decode-step). Here the weight is one sequential stream per thread, panel after panel, and each panel's
// successor is prefetched spread over the row tiles that use the current one. Prefill-sized batches are
// oneDNN's: kernels/cpu_linear.py measures which serves each shape and batch size.
//
// Layouts: panels [ceil(out / 32), in, 32] (pack_panels; padding columns are zero); x [rows, in] and out
// [rows, out] contiguous float32. Written with GCC vector types, so it builds for any CPU the extension is
// built for (-march=native picks the instructions).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>

namespace {

constexpr int64_t kCols = 32;  // a panel's output columns: two 16-float vectors
constexpr int kTile = 12;      // rows a micro-kernel computes at once (24 accumulators in registers)
constexpr int64_t kBlock = 8;  // row tiles per block: a block of x stays cache-resident while panels pass

typedef float Vec __attribute__((vector_size(64)));
typedef float UnalignedVec __attribute__((vector_size(64), aligned(4)));

inline Vec load(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<UnalignedVec*>(p) = v; }

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_panels takes a float32 [out, in] weight");
  const int64_t out = weight.size(0), in = weight.size(1), panels = (out + kCols - 1) / kCols;
  auto padded = at::zeros({panels * kCols, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({panels, kCols, in}).transpose(1, 2).contiguous();
}

// out[0:T, 0:cols] of one panel for T rows of x; every `tiles`-th k (offset `tile`) also prefetches the next
// panel's row k, so the row tiles sharing a panel fetch its successor once between them.
template <int T>
void tile_kernel(const float* x, int64_t in, const float* panel, const float* next, int64_t tile, int64_t tiles,
                 const float* bias, float* out, int64_t ld, int64_t cols) {
  Vec acc[T][2] = {};
  for (int64_t k = 0; k < in; ++k) {
    const Vec w0 = load(panel + k * kCols), w1 = load(panel + k * kCols + 16);
    if (next != nullptr && k % tiles == tile) {
      __builtin_prefetch(next + k * kCols);
      __builtin_prefetch(next + k * kCols + 16);
    }
#pragma GCC unroll 12
    for (int i = 0; i < T; ++i) {
      const float a = x[i * in + k];
      acc[i][0] += a * w0;
      acc[i][1] += a * w1;
    }
  }
  float row[kCols];
  for (int i = 0; i < T; ++i) {
    store(row, acc[i][0]);
    store(row + 16, acc[i][1]);
    if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) row[c] += bias[c];
    }
    std::memcpy(out + i * ld, row, cols * sizeof(float));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, int64_t, const float*, float*,
                        int64_t, int64_t);
constexpr TileFn kTiles[kTile + 1] = {nullptr,        tile_kernel<1>, tile_kernel<2>,  tile_kernel<3>, tile_kernel<4>,
                                      tile_kernel<5>, tile_kernel<6>, tile_kernel<7>,  tile_kernel<8>, tile_kernel<9>,
                                      tile_kernel<10>, tile_kernel<11>, tile_kernel<12>};

void linear_panels(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous float32 [rows, in]");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(1) == x.size(1) && panels.size(2) == kCols,
              "panels must come from pack_panels for this input width");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.size(1) <= panels.size(0) * kCols && out.size(1) > (panels.size(0) - 1) * kCols,
              "out must be contiguous [rows, out] for these panels");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == out.size(1)), "bias must be [out]");
  const int64_t rows = x.size(0), in = x.size(1), width = out.size(1), count = panels.size(0);
  const int64_t tiles = (rows + kTile - 1) / kTile;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {  // each thread its own run of panels
    for (int64_t t0 = 0; t0 < tiles; t0 += kBlock) {
      const int64_t t1 = std::min(tiles, t0 + kBlock);
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = wp + p * in * kCols;
        const float* next = p + 1 < end ? panel + in * kCols : nullptr;
        const int64_t cols = std::min(kCols, width - p * kCols);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r0 = t * kTile;
          kTiles[std::min<int64_t>(kTile, rows - r0)](xp + r0 * in, in, panel, next, t - t0, t1 - t0,
                                                      bp ? bp + p * kCols : nullptr, op + r0 * width + p * kCols,
                                                      width, cols);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("linear_panels(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("linear_panels", &linear_panels);
}
