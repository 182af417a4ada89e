// int4 quantization on the CPU, one pass each for the keys of whole cache blocks and for value rows
// (kernels/quant.py: quantize_int4_keys and quantize_int4_values, whose torch versions these are).
//
// Keys: per block,
// KV head and channel, the range [lo, hi] of the first `fill` slots' keys as e4m3 bytes (each end rounded down
// or up, the pair of least squared error), and each key as clamp(round((k - lo) / step), 0, 15), step =
// (hi - lo) / 15, two per byte (low nibble first); slots past `fill` get 0.
//
// Layouts: rows [blocks, block_size, kv_heads, head_dim] float32; fill [blocks] int64; packed [blocks,
// block_size, kv_heads, head_dim / 2] uint8; ranges [blocks, kv_heads, 2, head_dim] uint8.
//
// Values: per row (a token's KV head), levels -8..7 times one signed e4m3 scale, absmax / divisor for the
// divisor of least squared error. Layouts: rows [n, head_dim] float32; packed [n, head_dim / 2]; scales [n].
//
// Why compiled: the engine re-derives every block it writes keys into, in every layer of every step; as
// ~40 small torch ops that took a fifth of an int4 decode step on the CPU (the values' search, ~30 more).
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


// The nibble of key k in a range starting at lo with step st (0 for an empty range).
inline float level_of(float k, float lo, float st) {
  return st > 0.f ? std::min(std::max(std::nearbyint((k - lo) / st), 0.f), 15.f) : 0.f;
}

// `ends` [pairs, 2] bool: the (lo, hi) roundings tried for a channel's range, up or not, in order of preference
// (quant.py: INT4_KEY_RANGE_ENDS).
void quantize_int4_keys(const at::Tensor& rows, const at::Tensor& fill, const at::Tensor& ends, at::Tensor packed,
                        at::Tensor ranges) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 4,
              "rows must be contiguous float32 [blocks, block_size, kv_heads, head_dim] on the CPU");
  const int64_t n = rows.size(0), bs = rows.size(1), kvh = rows.size(2), d = rows.size(3);
  TORCH_CHECK(d % 2 == 0 && fill.scalar_type() == at::kLong && fill.numel() == n, "fill must be int64 [blocks]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == n * bs * kvh * d / 2,
              "packed must be contiguous uint8 [blocks, block_size, kv_heads, head_dim / 2]");
  TORCH_CHECK(ranges.scalar_type() == at::kByte && ranges.is_contiguous() && ranges.numel() == n * kvh * 2 * d,
              "ranges must be contiguous uint8 [blocks, kv_heads, 2, head_dim]");
  TORCH_CHECK(ends.scalar_type() == at::kBool && ends.dim() == 2 && ends.size(1) == 2 && ends.size(0) > 0,
              "ends must be bool [pairs, 2]");
  const auto fills = fill.contiguous();
  const auto ends_c = ends.contiguous();
  const bool* up = ends_c.data_ptr<bool>();
  const int64_t pairs = ends_c.size(0);
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
        const float* key = block + c;  // slot s: key[s * kvh * d]
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t s = 0; s < used; ++s) {
          mn = std::min(mn, key[s * kvh * d]);
          mx = std::max(mx, key[s * kvh * d]);
        }
        bool found = false;
        double best = 0.0;
        for (int64_t p = 0; p < pairs; ++p) {
          const bool lo_up = up[2 * p], hi_up = up[2 * p + 1];
          const uint8_t lo_bits = e4m3_directed(mn, lo_up), hi_bits = e4m3_directed(mx, hi_up);
          const float l = kvmesh::e4m3_to_float(lo_bits), st = (kvmesh::e4m3_to_float(hi_bits) - l) / 15.f;
          if (!(st >= 0.f)) continue;
          double err = 0.0;
          for (int64_t s = 0; s < used; ++s) {
            const double e = double(l) + double(st) * level_of(key[s * kvh * d], l, st) - key[s * kvh * d];
            err += e * e;
          }
          if (!found || err < best) {  // ties keep the earlier pair: outward first
            found = true;
            best = err;
            r[c] = lo_bits;
            r[d + c] = hi_bits;
            lo[c] = l;
            step[c] = st;
          }
        }
      }
      for (int64_t s = 0; s < bs; ++s) {
        uint8_t* dst = out + ((b * bs + s) * kvh + h) * d / 2;
        for (int64_t c = 0; c < d; c += 2) {
          uint8_t pair[2] = {0, 0};
          for (int64_t j = 0; j < 2 && s < used; ++j) {
            pair[j] = static_cast<uint8_t>(level_of(block[s * kvh * d + c + j], lo[c + j], step[c + j]));
          }
          dst[c / 2] = static_cast<uint8_t>(pair[0] | (pair[1] << 4));
        }
      }
    }
  });
}

inline float value_level(float v, float s) {
  return s != 0.f ? std::min(std::max(std::nearbyint(v / s), -8.f), 7.f) : 0.f;
}

// `divisors` [k] float32: the scales absmax / divisor tried, in order of preference (quant.py: INT4_VALUE_DIVISORS).
void quantize_int4_values(const at::Tensor& rows, const at::Tensor& divisors, at::Tensor packed, at::Tensor scales) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 2,
              "rows must be contiguous float32 [n, head_dim] on the CPU");
  const int64_t n = rows.size(0), d = rows.size(1);
  TORCH_CHECK(d % 2 == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == n * d / 2,
              "packed must be contiguous uint8 [n, head_dim / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.numel() == n,
              "scales must be contiguous uint8 [n]");
  TORCH_CHECK(divisors.scalar_type() == at::kFloat && divisors.dim() == 1 && divisors.numel() > 0,
              "divisors must be float32 [k]");
  const auto divs_c = divisors.contiguous();
  const std::vector<float> divs(divs_c.data_ptr<float>(), divs_c.data_ptr<float>() + divs_c.numel());
  const float* x = rows.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  uint8_t* sc = scales.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + i * d;
      float amax = 0.f, top = 0.f;  // the first element of largest magnitude, as torch's argmax takes it
      for (int64_t c = 0; c < d; ++c) {
        if (std::fabs(v[c]) > amax) {
          amax = std::fabs(v[c]);
          top = v[c];
        }
      }
      bool found = false;
      double best = 0.0;
      uint8_t bits = 0;
      float s = 0.f;
      for (const float divisor : divs) {
        const uint8_t b = e4m3_directed(amax / divisor, true) | (top > 0.f ? 128 : 0);
        const float cand = kvmesh::e4m3_to_float(b);
        double err = 0.0;
        for (int64_t c = 0; c < d; ++c) {
          const double e = double(value_level(v[c], cand)) * cand - v[c];
          err += e * e;
        }
        if (!found || err < best) {  // ties keep the earlier divisor
          found = true;
          best = err;
          bits = b;
          s = cand;
        }
      }
      sc[i] = bits;
      uint8_t* dst = out + i * d / 2;
      for (int64_t c = 0; c < d; c += 2) {
        const int lo = int(value_level(v[c], s)) + 8, hi = int(value_level(v[c + 1], s)) + 8;
        dst[c / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("quantize_int4_keys(Tensor rows, Tensor fill, Tensor ends, Tensor(a!) packed, Tensor(b!) ranges) -> ()");
  m.def("quantize_int4_values(Tensor rows, Tensor divisors, Tensor(a!) packed, Tensor(b!) scales) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) {
  m.impl("quantize_int4_keys", &quantize_int4_keys);
  m.impl("quantize_int4_values", &quantize_int4_values);
}
