// strata._native.fit_config: the config fit (offload/config_fit.h, Note
// [Config fit]; `strata plan --fit` on the CLI) for a model the Python side
// describes as layers (strata.torch.initialize(..., fit=...)). The search
// reads only the layers' element counts and dtypes: nothing is allocated.
#include <sys/statvfs.h>

#include <cerrno>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "checked_config.h"
#include "errors.h"
#include "layer_tuples.h"
#include "strata/core/config.h"
#include "strata/cpu_adam/moment_storage.h"
#include "strata/core/printable.h"
#include "strata/core/spec_model.h"
#include "strata/offload/config_fit.h"

namespace py = pybind11;

namespace strata::python {
namespace {

// Training FLOPs per token of a dense model: 6 per parameter (forward 2,
// backward 4); only the ranking of placements uses it (the built-in profile
// is relative).
constexpr double kFlopsPerParameterPerToken = 6.0;

py::dict change_dict(const offload::FitChange& c) {
  py::dict d;
  d["key"] = c.key;
  d["before"] = c.before;
  d["after"] = c.after;
  d["reason"] = c.reason;
  return d;
}

py::dict candidate_dict(const offload::FitCandidate& c) {
  py::dict d;
  d["label"] = c.label;
  d["fits"] = c.fits;
  d["bound"] = c.bound;
  d["config_json"] = config_to_json(c.config).dump();
  py::list changes;
  for (const offload::FitChange& change : c.changes) changes.append(change_dict(change));
  d["changes"] = changes;
  d["predicted_step_ms"] = c.predicted.step_ms;  // the built-in profile: for ranking only
  py::dict memory;
  memory["device"] = c.memory.device;
  memory["pinned"] = c.memory.pinned;
  memory["nvme"] = c.memory.nvme;
  d["memory"] = memory;
  return d;
}

// The search for `layers` trained with the config (path or JSON text) at
// `world` ranks under the caps: {"fits", "best" (a candidate) or None,
// "runners_up", "missing", "suggestions"}. nvme_path empty: no NVMe
// placement; else its free space is the NVMe cap.
py::dict fit_config(const std::optional<std::string>& config_path, const std::optional<std::string>& config_text,
                    const std::vector<LayerTuple>& layers, uint64_t device_bytes, uint64_t host_bytes,
                    const std::string& nvme_path, int world, int seq,
                    const std::vector<std::string>& optimizer_states, const std::vector<std::string>& grad_dtypes) {
  if (device_bytes == 0) raise_status(InvalidArgument("fit: device_memory must be > 0 (the device's capacity)"));
  if (host_bytes == 0) raise_status(InvalidArgument("fit: host_memory must be > 0 (pinned host memory for the engine)"));
  if (seq < 1 || seq > (1 << 24)) raise_status(InvalidArgument(fmt::format("fit: seq {} is not in 1..16777216", seq)));
  ConfigOptions options;
  options.world_size = world;
  options.world_size_origin = world == 1 ? "strata.torch (one process)" : fmt::format("mpirun -np {}", world);
  const ConfigCheck check = checked_config(config_path, config_text, options);
  const SpecModel model = value_or_raise(SpecModel::create(describe_layers(layers)));
  offload::FitRequest request;
  request.layers.assign(model.layers().begin(), model.layers().end());
  request.config = check.config;
  request.world = world;
  request.micro_batch = static_cast<int>(check.config.batch.train_micro_batch_size_per_gpu.value_or(1));
  request.grad_accum = static_cast<int>(check.config.batch.gradient_accumulation_steps.value_or(1));
  request.seq = seq;
  uint64_t parameters = 0;
  for (const LayerSpec& l : request.layers) parameters += l.param_count;
  request.flops_per_token = kFlopsPerParameterPerToken * static_cast<double>(parameters);
  request.profile = offload::builtin_cpu_profile();
  request.device = offload::PlannedDevice::cpu();
  // torch's activations are not the engine's: the caps are the engine's memory (docs/torch.md).
  request.device_reserve = [](DType, DType, int) -> uint64_t { return 0; };
  for (const std::string& name : optimizer_states)
    request.moment_storages.push_back(
        value_or_raise(cpu_adam::MomentStorage::parse(name, "fit['optimizer_states']")));
  for (const std::string& name : grad_dtypes) {
    Result<DType> g = parse_dtype(name);
    if (!g.ok() || !is_state_float(*g))
      raise_status(InvalidArgument(fmt::format("fit['grad_dtypes'] '{}' is not a gradient dtype; use fp32, bf16 or "
                                               "fp16",
                                               printable(name, 64))));
    request.grad_dtypes.push_back(*g);
  }

  offload::FitCaps caps;
  caps.device_bytes = device_bytes;
  caps.host_bytes = host_bytes;
  caps.ranks_per_node = world;
  if (!nvme_path.empty()) {
    struct statvfs vfs {};
    if (::statvfs(nvme_path.c_str(), &vfs) != 0)
      raise_status(ErrnoStatus(errno, fmt::format("fit: nvme_path '{}'", printable(nvme_path, 256))));
    caps.nvme_bytes = static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
    caps.nvme_path = nvme_path;
  }
  Result<offload::FitResult> searched = [&] {
    py::gil_scoped_release unlocked;
    return offload::fit_config(request, caps);
  }();
  const offload::FitResult result = value_or_raise(std::move(searched));
  py::dict out;
  out["fits"] = result.ok();
  out["best"] = result.ok() ? py::object(candidate_dict(result.fitting.front())) : py::object(py::none());
  py::list runners_up;
  for (size_t i = 1; i < result.fitting.size() && i < 4; ++i) runners_up.append(candidate_dict(result.fitting[i]));
  out["runners_up"] = runners_up;
  out["missing"] = result.missing;
  out["suggestions"] = result.suggestions;
  return out;
}

}  // namespace

void bind_fit(py::module_& m) {
  m.def("fit_config", &fit_config, py::arg("config_path"), py::arg("config_text"), py::arg("layers"),
        py::arg("device_bytes"), py::arg("host_bytes"), py::arg("nvme_path") = "", py::arg("world") = 1,
        py::arg("seq") = 512, py::arg("optimizer_states") = std::vector<std::string>{},
        py::arg("grad_dtypes") = std::vector<std::string>{});
}

}  // namespace strata::python
