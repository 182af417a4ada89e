// int4 keys of whole cache blocks (kernels/quant.py: quantize_int4_keys, whose torch version this is): per block,
// KV head and channel, the range [lo, hi] of the first `fill` slots' keys as e4m3 bytes rounded outward, and
// each key as round((k - lo) / step), step = (hi - lo) / 15, two per byte (low nibble first); slots past
// `fill` get 0.
//
// Why compiled: the engine re-derives every block it writes keys into, in every layer of every step; as
// ~40 small torch ops that took a fifth of an int4 decode step on the CPU.
//
// Layouts: rows [blocks, block_size, kv_heads, head_dim] float32; fill [blocks] int64; packed [blocks,
// block_size, kv_heads, head_dim / 2] uint8; ranges [blocks, kv_heads, 2, head_dim] uint8.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "paged_cache.h"

namespace {

// x on e4m3's grid, rounded toward +inf (up) or -inf, as its byte; saturates at +-448.
inline uint8_t e4m3_directed(float x, bool up) {
  x = std::min(std::max(x, -448.f), 448.f);
  const c10::Float8_e4m3fn near(x);
  const float v = static_cast<float>(near);
  uint8_t bits = near.x;
  if (up ? v < x : v > x) {
    int magnitude = bits & 127, negative = bits >> 7;
    magnitude += (negative ? -1 : 1) * (up ? 1 : -1);  // one grid step the wanted way
    if (magnitude < 0) {  // stepped across zero
      negative ^= 1;
      magnitude = -magnitude;
    }
    bits = static_cast<uint8_t>((negative << 7) | magnitude);
  }
  return bits;
}

void quantize_int4_keys(const at::Tensor& rows, const at::Tensor& fill, at::Tensor packed, at::Tensor ranges) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 4,
              "rows must be contiguous float32 [blocks, block_size, kv_heads, head_dim] on the CPU");
  const int64_t n = rows.size(0), bs = rows.size(1), kvh = rows.size(2), d = rows.size(3);
  TORCH_CHECK(d % 2 == 0 && fill.scalar_type() == at::kLong && fill.numel() == n, "fill must be int64 [blocks]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == n * bs * kvh * d / 2,
              "packed must be contiguous uint8 [blocks, block_size, kv_heads, head_dim / 2]");
  TORCH_CHECK(ranges.scalar_type() == at::kByte && ranges.is_contiguous() && ranges.numel() == n * kvh * 2 * d,
              "ranges must be contiguous uint8 [blocks, kv_heads, 2, head_dim]");
  const auto fills = fill.contiguous();
  const float* x = rows.data_ptr<float>();
  const int64_t* f = fills.data_ptr<int64_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  uint8_t* rng = ranges.data_ptr<uint8_t>();
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> lo(d), step(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kvh, h = task % kvh, used = std::min(std::max<int64_t>(f[b], 0), bs);
      const float* block = x + b * bs * kvh * d + h * d;  // slot s, channel c: block[s * kvh * d + c]
      uint8_t* r = rng + (b * kvh + h) * 2 * d;
      for (int64_t c = 0; c < d; ++c) {
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t s = 0; s < used; ++s) {
          mn = std::min(mn, block[s * kvh * d + c]);
          mx = std::max(mx, block[s * kvh * d + c]);
        }
        r[c] = e4m3_directed(mn, false);
        r[d + c] = e4m3_directed(mx, true);
        lo[c] = kvmesh::e4m3_to_float(r[c]);
        step[c] = (kvmesh::e4m3_to_float(r[d + c]) - lo[c]) / 15.f;
      }
      for (int64_t s = 0; s < bs; ++s) {
        uint8_t* dst = out + ((b * bs + s) * kvh + h) * d / 2;
        for (int64_t c = 0; c < d; c += 2) {
          uint8_t pair[2] = {0, 0};
          for (int64_t j = 0; j < 2 && s < used; ++j) {
            const float level = step[c + j] > 0.f ? std::nearbyint((block[s * kvh * d + c + j] - lo[c + j]) / step[c + j]) : 0.f;
            pair[j] = static_cast<uint8_t>(std::min(std::max(level, 0.f), 15.f));
          }
          dst[c / 2] = static_cast<uint8_t>(pair[0] | (pair[1] << 4));
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("quantize_int4_keys(Tensor rows, Tensor fill, Tensor(a!) packed, Tensor(b!) ranges) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) { m.impl("quantize_int4_keys", &quantize_int4_keys); }
