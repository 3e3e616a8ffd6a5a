// strata._native.LrSchedule: the engine's learning-rate schedule
// (offload/lr_schedule.h) for the Python side, so strata.torch's
// DeepSpeed-named schedulers (strata/torch/runtime/lr_schedules.py) compute
// the same values as the engine's config "scheduler" section, from one
// implementation. Built from a config (JSON text) checked as `strata config
// check` checks it; its scheduler section and optimizer lr are the schedule's.
#include <array>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "checked_config.h"
#include "errors.h"
#include "strata/offload/lr_schedule.h"

namespace strata::python {
namespace {

class PyLrSchedule {
 public:
  explicit PyLrSchedule(const std::string& config_json)
      : schedule_(make(config_json)) {}

  // The lr of the step-th applied optimizer update (1-based).
  double lr(int64_t step) const {
    check_step(step);
    return schedule_.lr(step);
  }

  // (beta1, beta2) of that update where the schedule cycles momentum, else None.
  std::optional<std::array<double, 2>> betas(int64_t step) const {
    check_step(step);
    return schedule_.betas(step);
  }

  std::string type() const { return std::string(scheduler_type_name(schedule_.type())); }

 private:
  static offload::LrSchedule make(const std::string& config_json) {
    ConfigOptions options;
    const ConfigCheck check = checked_config(std::nullopt, config_json, options);
    return value_or_raise(
        offload::LrSchedule::create(check.config.scheduler, check.config.optimizer.lr, check.config.source));
  }

  static void check_step(int64_t step) {
    if (step < 1 || step > (int64_t{1} << 53))
      raise_status(InvalidArgument(fmt::format("LrSchedule step {} is not an optimizer update count in 1..2^53", step)));
  }

  offload::LrSchedule schedule_;
};

}  // namespace

void bind_lr_schedule(py::module_& m) {
  py::class_<PyLrSchedule>(m, "LrSchedule")
      .def(py::init<const std::string&>(), py::arg("config_json"))
      .def("lr", &PyLrSchedule::lr, py::arg("step"))
      .def("betas", &PyLrSchedule::betas, py::arg("step"))
      .def_property_readonly("type", &PyLrSchedule::type);
}

}  // namespace strata::python
