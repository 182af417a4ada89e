// A linear layer on a oneDNN-prepacked weight, its rows shared out between threads.
//
// Why: on bf16 weights oneDNN's AMX GEMM leaves threads idle on some shapes: with two threads SmolLM2's down
// projection (1,536 -> 576) at 512 rows took as long as with one (benchmarks/cpu_linear.py). Here each thread
// runs oneDNN on its own block of at least `min_rows` rows, single-threaded (it is called inside a parallel
// region), and copies that block into the output. Which of the two is faster depends on the shape:
// kernels/cpu_linear.py measures.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <optional>

namespace {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>);

void linear_rows(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                 int64_t min_rows) {
  static const auto linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearFn>();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0),
              "linear_rows takes contiguous [rows, in] and [rows, out]");
  const int64_t rows = x.size(0);
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / std::max<int64_t>(min_rows, 1)));
  const bool inference = c10::InferenceMode::is_enabled();
  const c10::List<std::optional<c10::Scalar>> no_scalars;
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);  // the caller's mode: worker threads do not inherit it
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r0 = rows * p / parts, n = rows * (p + 1) / parts - r0;
      out.narrow(0, r0, n).copy_(linear.call(x.narrow(0, r0, n), packed, bias, "none", no_scalars, std::nullopt));
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("linear_rows(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int min_rows) -> ()");
}

// The packed weight is a oneDNN tensor, which makes the dispatcher look for a MkldnnCPU kernel.
TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) { m.impl("linear_rows", &linear_rows); }
TORCH_LIBRARY_IMPL(kvmesh_cpu, MkldnnCPU, m) { m.impl("linear_rows", &linear_rows); }
