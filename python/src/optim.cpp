// Bindings of cpu_adam's CpuOptimizer. The Python optimizer (strata/optim.py)
// checks every tensor (CPU, contiguous, dtype, shape) and passes one list of
// raw spans per param group; step_spans steps them all in one call with the
// GIL released, each span with its own step count (torch keeps one per
// parameter, and a loaded state dict may mix them).
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "errors.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::python {
namespace {

using cpu_adam::CpuOptimizer;

Result<DType> parse_dtype(const std::string& name, const char* what) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  return InvalidArgument(fmt::format("{}: dtype '{}' is not float32, bfloat16 or float16", what, name));
}

// One tensor's state: (count, params, grads, grad_dtype, exp_avg, exp_avg_sq,
// moment_dtype, param_copy, copy_dtype, step). Addresses as integers
// (tensor.data_ptr()); 0 for an unused span.
using SpanTuple = std::tuple<uint64_t, uintptr_t, uintptr_t, std::string, uintptr_t, uintptr_t, std::string,
                             uintptr_t, std::string, int64_t>;

struct Job {
  cpu_adam::StateSpans spans;
  int64_t step = 1;
};

class PyCpuOptimizer {
 public:
  PyCpuOptimizer(const std::string& kind, int threads, size_t tile_elements, const std::string& path)
      : optimizer_(make(kind, threads, tile_elements, path)) {}

  // Steps every span; returns the tiles computed. Raises on invalid input,
  // naming the span's index in the group.
  size_t step_spans(const std::vector<SpanTuple>& spans, double lr, double beta1, double beta2, double eps,
                    double weight_decay, bool bias_correction, double loss_scale, double clip_coefficient) {
    std::vector<Job> jobs;
    jobs.reserve(spans.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      const auto& [count, params, grads, grad_dtype, exp_avg, exp_avg_sq, moment_dtype, copy, copy_dtype, step] =
          spans[i];
      Job job;
      job.spans.count = count;
      job.spans.params = reinterpret_cast<float*>(params);
      job.spans.grads = reinterpret_cast<const void*>(grads);
      job.spans.grad_dtype = value_or_raise(parse_dtype(grad_dtype, "grad"));
      job.spans.exp_avg = reinterpret_cast<void*>(exp_avg);
      job.spans.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
      job.spans.moment_dtype = value_or_raise(parse_dtype(moment_dtype, "moments"));
      job.spans.param_copy = reinterpret_cast<void*>(copy);
      job.spans.param_copy_dtype = value_or_raise(parse_dtype(copy_dtype, "param copy"));
      job.step = step;
      jobs.push_back(job);
    }
    cpu_adam::StepArgs args;
    args.hyper = {.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay,
                  .bias_correction = bias_correction};
    args.loss_scale = loss_scale;
    args.clip_coefficient = clip_coefficient;
    // torch semantics: a non-finite gradient is applied, not skipped, and no
    // extra read of the gradient is paid for a check the caller did not ask for.
    args.overflow_check = cpu_adam::OverflowCheck::kAssumeFinite;
    Status failed;
    size_t tiles = 0;
    {
      py::gil_scoped_release release;
      for (size_t i = 0; i < jobs.size(); ++i) {
        if (jobs[i].spans.count == 0) continue;
        args.step = jobs[i].step;
        auto report = optimizer_.step(args, jobs[i].spans);
        if (!report.ok()) {
          failed = report.status().with_context(fmt::format("tensor {} of the group ({} elements)", i, jobs[i].spans.count));
          break;
        }
        tiles += report->tiles;
      }
    }
    throw_if_error(failed);
    return tiles;
  }

  // Squared L2 norm and finiteness of one gradient span (GIL released).
  std::pair<double, bool> grad_stats(uintptr_t grads, const std::string& dtype, uint64_t count) {
    const DType d = value_or_raise(parse_dtype(dtype, "grad"));
    Result<cpu_adam::GradStats> stats = InvalidArgument("unreached");
    {
      py::gil_scoped_release release;
      stats = optimizer_.grad_stats(reinterpret_cast<const void*>(grads), d, count);
    }
    auto s = value_or_raise(std::move(stats));
    return {s.sum_squares, s.all_finite};
  }

  std::string kind() const { return std::string(cpu_adam::optimizer_kind_name(optimizer_.kind())); }
  std::string path() const { return std::string(cpu_adam::kernel_path_name(optimizer_.path())); }
  std::string path_reason() const { return optimizer_.path_reason(); }
  int threads() const { return optimizer_.threads(); }
  size_t tile_elements() const { return optimizer_.tile_elements(); }

 private:
  static CpuOptimizer make(const std::string& kind, int threads, size_t tile_elements, const std::string& path) {
    cpu_adam::OptimizerOptions options;
    options.kind = value_or_raise(cpu_adam::parse_optimizer_kind(kind));
    options.threads = threads;
    options.tile_elements = tile_elements;
    options.path = value_or_raise(cpu_adam::parse_kernel_path(path));
    return value_or_raise(CpuOptimizer::create(options));
  }

  CpuOptimizer optimizer_;
};

}  // namespace

void bind_optim(py::module_& m) {
  py::class_<PyCpuOptimizer>(m, "CpuOptimizer", "cpu_adam's tiled, multi-threaded optimizer step")
      .def(py::init<const std::string&, int, size_t, const std::string&>(), py::arg("kind"), py::arg("threads") = 0,
           py::arg("tile_elements") = 65536, py::arg("path") = "auto")
      .def("step_spans", &PyCpuOptimizer::step_spans, py::arg("spans"), py::arg("lr"), py::arg("beta1"),
           py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction"),
           py::arg("loss_scale") = 1.0, py::arg("clip_coefficient") = 1.0)
      .def("grad_stats", &PyCpuOptimizer::grad_stats, py::arg("grads"), py::arg("dtype"), py::arg("count"))
      .def_property_readonly("kind", &PyCpuOptimizer::kind)
      .def_property_readonly("path", &PyCpuOptimizer::path)
      .def_property_readonly("path_reason", &PyCpuOptimizer::path_reason)
      .def_property_readonly("threads", &PyCpuOptimizer::threads)
      .def_property_readonly("tile_elements", &PyCpuOptimizer::tile_elements);
  m.def("supported_kernel_paths", [] {
    std::vector<std::string> names;
    for (auto p : cpu_adam::supported_kernel_paths()) names.emplace_back(cpu_adam::kernel_path_name(p));
    return names;
  });
}

}  // namespace strata::python
