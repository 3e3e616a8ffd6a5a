#pragma once
// How a C++ Status becomes a Python exception. The exception classes live in
// strata/errors.py (so they can have two bases, e.g. InvalidArgument is also
// a ValueError); the package hands them to the module at import time
// (_native._register_errors) and every failing call raises the class of its
// StatusCode with the Status text as the message and the code name as
// `.code`.

#include <pybind11/pybind11.h>

#include "strata/core/status.h"

namespace strata::python {

namespace py = pybind11;

// Raises the Python exception for a failed status (throws py::error_already_set).
[[noreturn]] void raise_status(const Status& status);

inline void throw_if_error(const Status& status) {
  if (!status.ok()) raise_status(status);
}

template <typename T>
T value_or_raise(Result<T>&& result) {
  if (!result.ok()) raise_status(result.status());
  return std::move(*result);
}

void bind_errors(py::module_& m);
void bind_optim(py::module_& m);
void bind_io(py::module_& m);
void bind_config(py::module_& m);
void bind_engine(py::module_& m);
void bind_fit(py::module_& m);
void bind_lr_schedule(py::module_& m);

}  // namespace strata::python
