// The transformer's elementwise layers on the CPU, each one pass over its rows (kernels/layers.py).
//
// Why compiled: in torch each of these is several kernels with a temporary between them (RMSNorm: pow,
// mean, add, rsqrt, two multiplies; SiLU-and-mul: silu on a strided half, then a multiply; rotary: two
// gathers of the tables, a cat, four multiplies), and on a prefill step every temporary is megabytes that
// leave the cache. Here a row is read once and written once, with the same arithmetic in float.
//
// rms_norm(out, x, w, eps):              out = w * (x / sqrt(mean(x^2) + eps)), rows of x [rows, dim]
// add_rms_norm(x, residual, w, eps):     residual += x; x = rms_norm(residual) (both in place)
// silu_and_mul(out, x):                  out = silu(x[:, :d]) * x[:, d:], x [rows, 2d]
// rotary(q, k, cos, sin, positions):     q, k [tokens, heads, head_dim] (rows may be strided) rotated in
//                                        place, rotate-half style, by cos/sin [max_positions, head_dim] rows
// The normalised value is rounded to x's dtype before the weight multiplies it, as Hugging Face's
// Llama does, so half-precision models round where theirs do.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "convert.h"

namespace {

using kvmesh::from_float;
using kvmesh::round_to;
using kvmesh::to_float;

constexpr int64_t kRowGrain = 16;

template <typename T>
inline void norm_row(const float* src, T* dst, const T* w, int64_t dim, double eps) {
  float sq = 0.f;  // a plain loop: -ffast-math vectorizes it with register accumulators
  for (int64_t i = 0; i < dim; ++i) sq += src[i] * src[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(dim) + static_cast<float>(eps));
  for (int64_t i = 0; i < dim; ++i) {
    const float normed = round_to<T>(src[i] * inv);
    dst[i] = from_float<T>(to_float(w[i]) * normed);
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, dim] on the CPU");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [dim] of x's dtype");
  const int64_t rows = x.size(0), dim = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(dim);
      for (const auto r : c10::irange(begin, end)) {
        for (const auto i : c10::irange(dim)) row[i] = to_float(xp[r * xs + i]);
        norm_row(row.data(), op + r * os, w, dim, eps);
      }
    });
  });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [dim] of x's dtype");
  const int64_t rows = x.size(0), dim = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(dim);
      for (const auto r : c10::irange(begin, end)) {
        scalar_t* xr = xp + r * xs;
        scalar_t* rr = rp + r * rs;
        for (const auto i : c10::irange(dim)) {
          rr[i] = from_float<scalar_t>(to_float(xr[i]) + to_float(rr[i]));
          row[i] = to_float(rr[i]);
        }
        norm_row(row.data(), xr, w, dim, eps);
      }
    });
  });
}

template <typename T>
inline void silu_mul_row(const T* gate, T* dst, int64_t d) {
  const T* up = gate + d;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = to_float(gate[i]);
    // silu is rounded to the dtype before the multiply, as torch's silu(gate) * up would be.
    const float s = round_to<T>(g / (1.f + std::exp(-g)));
    dst[i] = from_float<T>(s * to_float(up[i]));
  }
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * d && out.size(0) == rows && out.size(1) == d && out.scalar_type() == x.scalar_type(),
              "out must be [rows, dim / 2] of x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (const auto r : c10::irange(begin, end)) {
        silu_mul_row(xp + r * xs, op + r * os, d);
      }
    });
  });
}

template <typename T>
inline void rotate(T* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_float(x[i]), b = to_float(x[i + half]);
    x[i] = from_float<T>(a * c[i] - b * s[i]);
    x[i + half] = from_float<T>(b * c[i + half] + a * s[i + half]);
  }
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2) && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q/k must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k dtypes differ");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.size(1) == q.size(2) && sin.sizes() == cos.sizes(),
              "cos/sin must be contiguous float32 [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == q.size(0), "positions: int64 [tokens]");
  const int64_t tokens = q.size(0), qh = q.size(1), kh = k.size(1), d = q.size(2), half = d / 2;
  const int64_t max_pos = cos.size(0);
  const auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (const auto t : c10::irange(tokens)) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " is outside the rotary table");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t qs = q.stride(0), ks = k.stride(0);
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (const auto t : c10::irange(begin, end)) {
        const float* c = cp + pp[t] * d;
        const float* s = sp + pp[t] * d;
        for (const auto h : c10::irange(qh)) rotate(qp + t * qs + h * d, c, s, half);
        for (const auto h : c10::irange(kh)) rotate(kp + t * ks + h * d, c, s, half);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor positions) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
