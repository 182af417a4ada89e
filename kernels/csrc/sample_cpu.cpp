// The sampler's CPU kernels (replica/sampler.py): the rejection path fused, and the greedy argmax.
//
// Why compiled: over a 49k vocabulary the torch version makes a dozen passes over every row (softmax,
// block sums, comparisons, masked sums), each a separate kernel writing a temporary; here a row is read
// three times and stays in cache.
//
// Per row: the exponentials of (x - max) and their sum in one pass, keeping the sums of blocks of 64
// tokens; then per round, the token where u * total of the mass is reached (the block sums find its block,
// a scan of that block finds the token) and, for a row with top_p < 1 or min_p > 0, the mass of the tokens
// more likely than it: the draw is kept if that mass is under top_p * total and its probability is at least
// min_p times the top token's (which is 1 here). A row with no draw kept after every round gets -1: the
// caller sorts it.
//
// x: [rows, vocab] float32, temperature already applied; top_p, min_p: [rows] float32; u: [rows, rounds]
// float64 in (0, 1), one number per round; out: [rows] int64.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;

void sample_rows(const at::Tensor& x, const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u,
                 at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous float32 [rows, vocab] on the CPU");
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && min_p.scalar_type() == at::kFloat &&
                  u.scalar_type() == at::kDouble && out.scalar_type() == at::kLong,
              "top_p/min_p float32, u float64, out int64");
  const int64_t rows = x.size(0), vocab = x.size(1), rounds = u.size(1);
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  const auto tp_c = top_p.contiguous(), mp_c = min_p.contiguous(), u_c = u.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* tp = tp_c.data_ptr<float>();
  const float* mp = mp_c.data_ptr<float>();
  const double* up = u_c.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ex(vocab);
    std::vector<double> block_sum(blocks);
    for (const auto r : c10::irange(begin, end)) {
      const float* xr = xp + r * vocab;
      float m = xr[0];
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < vocab; ++i) m = std::max(m, xr[i]);
      double total = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = lo; i < hi; ++i) s += (ex[i] = std::exp(xr[i] - m));
        block_sum[b] = s;
        total += s;
      }
      const bool filtered = tp[r] < 1.f || mp[r] > 0.f;
      int64_t chosen = -1;
      for (int64_t round = 0; round < rounds && chosen < 0; ++round) {
        const double target = up[r * rounds + round] * total;
        double acc = 0.0;
        int64_t b = 0;
        while (b < blocks - 1 && acc + block_sum[b] < target) acc += block_sum[b++];
        int64_t j = b * kBlock;
        const int64_t last = std::min(vocab, j + kBlock) - 1;
        while (j < last && acc + ex[j] < target) acc += ex[j++];
        if (!filtered) {
          chosen = j;
          break;
        }
        const float ej = ex[j];
        double above = 0.0;
        float part = 0.f;
        for (int64_t b2 = 0; b2 < blocks; ++b2) {  // a float sum per block, a double sum of the blocks
          const int64_t lo = b2 * kBlock, hi = std::min(vocab, lo + kBlock);
          part = 0.f;
#pragma omp simd reduction(+ : part)
          for (int64_t i = lo; i < hi; ++i) part += ex[i] > ej ? ex[i] : 0.f;
          above += part;
        }
        if (above < static_cast<double>(tp[r]) * total && ej >= mp[r]) chosen = j;
      }
      op[r] = chosen;
    }
  });
}

// Greedy: the first index of each row's maximum. A vectorised max, then a scan that stops at it: torch's
// argmax on the CPU keeps an index per lane and runs several times slower on long rows.
void argmax_rows(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous float32 [rows, vocab] on the CPU");
  TORCH_CHECK(out.scalar_type() == at::kLong, "out must be int64");
  const int64_t rows = x.size(0), vocab = x.size(1);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (const auto r : c10::irange(begin, end)) {
      const float* xr = xp + r * vocab;
      float m = xr[0];
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < vocab; ++i) m = std::max(m, xr[i]);
      int64_t j = 0;
      while (j < vocab - 1 && !(xr[j] == m)) ++j;  // NaN rows end at the last index
      op[r] = j;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("sample_rows(Tensor x, Tensor top_p, Tensor min_p, Tensor u, Tensor(a!) out) -> ()");
  m.def("argmax_rows(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("argmax_rows", &argmax_rows);
}
