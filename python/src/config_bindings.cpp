// Bindings of core's config checker and memory estimator: the same engine as
// `strata config check` and `strata estimate`, with JSON text crossing the
// boundary (the Python layer turns it into dicts and lists).
#include <optional>
#include <string>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "errors.h"
#include "strata/core/config.h"
#include "strata/core/estimator.h"
#include "strata/core/units.h"
#include "strata/offload/engine.h"

namespace strata::python {
namespace {

py::dict check_result(const ConfigCheck& check) {
  py::list issues;
  for (const ConfigIssue& issue : check.issues) {
    py::dict d;
    d["severity"] = issue.severity == IssueSeverity::kError ? "error" : "warning";
    d["path"] = issue.path;
    d["message"] = issue.message;
    d["hint"] = issue.hint;
    d["text"] = format_issue(issue, check.config.source);
    issues.append(d);
  }
  py::dict out;
  out["issues"] = issues;
  out["ok"] = check.ok();
  out["config_json"] =
      check.ok() ? py::object(py::str(config_to_json(check.config).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)))
                 : py::object(py::none());
  return out;
}

ConfigOptions config_options(int64_t world_size, std::optional<int64_t> hidden_size) {
  if (world_size < 1) raise_status(InvalidArgument(fmt::format("world_size {} must be at least 1", world_size)));
  // "auto" bucket sizes are hidden_size^2: beyond 2^24 that leaves int64.
  if (hidden_size && (*hidden_size < 1 || *hidden_size > (int64_t{1} << 24)))
    raise_status(InvalidArgument(fmt::format("hidden_size {} is out of range: give 1..{} (the model's hidden "
                                             "width, which \"auto\" bucket sizes are computed from)",
                                             *hidden_size, int64_t{1} << 24)));
  ConfigOptions options;
  options.world_size = world_size;
  options.hidden_size = hidden_size;
  return options;
}

ConfigCheck check_either(const std::optional<std::string>& path, const std::optional<std::string>& text,
                         const ConfigOptions& options) {
  if (path) return check_config_file(*path, options);
  ConfigOptions named = options;
  named.source = "<dict>";
  return check_config_text(*text, named);
}

uint64_t parse_or_raise_count(const std::string& text, const char* what) {
  return value_or_raise(parse_count(text, what));
}

std::string estimate(const std::string& params, const std::optional<std::string>& largest_layer,
                     uint32_t gpus_per_node, uint32_t nodes, const std::optional<std::string>& config_path,
                     const std::optional<std::string>& config_text, const std::optional<std::string>& gpu_memory,
                     const std::optional<std::string>& cpu_memory, const std::optional<std::string>& nvme_memory,
                     const std::optional<std::string>& precision, const std::optional<std::string>& grad_dtype,
                     const std::optional<std::string>& optimizer_states) {
  EstimateInput input;
  input.params = parse_or_raise_count(params, "params");
  if (largest_layer) input.largest_layer_params = parse_or_raise_count(*largest_layer, "largest_layer_params");
  if (gpus_per_node < 1 || gpus_per_node > 4096) {
    raise_status(InvalidArgument(fmt::format("gpus_per_node {} is outside [1, 4096]", gpus_per_node)));
  }
  if (nodes < 1 || nodes > (1u << 20)) {
    raise_status(InvalidArgument(fmt::format("nodes {} is outside [1, 1048576]", nodes)));
  }
  input.gpus_per_node = gpus_per_node;
  input.nodes = nodes;
  for (auto [text, what, slot] : {std::tuple{&gpu_memory, "gpu_memory", &input.gpu_memory_bytes},
                                  std::tuple{&cpu_memory, "cpu_memory", &input.cpu_memory_bytes},
                                  std::tuple{&nvme_memory, "nvme_memory", &input.nvme_memory_bytes}}) {
    if (*text) *slot = value_or_raise(parse_bytes(**text, what));
  }
  const bool have_config = config_path || config_text;
  if (have_config) {
    const ConfigCheck check = check_either(config_path, config_text, config_options(static_cast<int64_t>(input.world_size()), {}));
    if (!check.ok()) {
      std::string errors;
      for (const ConfigIssue& issue : check.issues) {
        if (issue.severity == IssueSeverity::kError) errors += "\n  " + format_issue(issue, check.config.source);
      }
      raise_status(InvalidArgument(fmt::format("the config is not valid ({} error(s)):{}", check.error_count(), errors)));
    }
    input.from_config(check.config);
  }
  if (!have_config || precision || grad_dtype || optimizer_states) {
    input.precision = value_or_raise(
        ledger_precision(precision.value_or("bf16"), grad_dtype.value_or(""), optimizer_states.value_or("fp32")));
  }
  Estimate e = value_or_raise(estimate_memory(input));
  return estimate_to_json(e).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

void bind_config(py::module_& m) {
  m.def(
      "check_config",
      [](std::optional<std::string> path, std::optional<std::string> text, int64_t world_size,
         std::optional<int64_t> hidden_size) {
        return check_result(check_either(path, text, config_options(world_size, hidden_size)));
      },
      py::arg("path") = py::none(), py::arg("text") = py::none(), py::arg("world_size") = 1,
      py::arg("hidden_size") = py::none());
  m.def(
      "nvme_pipelines_note",
      [](const std::string& optimizer_device, bool pipeline_read, bool pipeline_write) {
        const OffloadDevice device = optimizer_device == "nvme" ? OffloadDevice::kNvme : OffloadDevice::kNone;
        return offload::nvme_pipelines_note(device, pipeline_read, pipeline_write);
      },
      py::arg("optimizer_device"), py::arg("pipeline_read"), py::arg("pipeline_write"));
  m.def("estimate", &estimate, py::arg("params"), py::arg("largest_layer_params") = py::none(),
        py::arg("gpus_per_node") = 1, py::arg("nodes") = 1, py::arg("config_path") = py::none(),
        py::arg("config_text") = py::none(), py::arg("gpu_memory") = py::none(), py::arg("cpu_memory") = py::none(),
        py::arg("nvme_memory") = py::none(), py::arg("precision") = py::none(), py::arg("grad_dtype") = py::none(),
        py::arg("optimizer_states") = py::none());
}

}  // namespace strata::python
