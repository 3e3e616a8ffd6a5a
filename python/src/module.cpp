// strata._native: the one native module of the Python package. The Python
// layer (strata/) checks tensors and hands raw pointers here; nothing here
// links libtorch, so any PyTorch (and numpy) works. Every call that steps,
// reads or writes releases the GIL.
#include <map>
#include <string>

#include <pybind11/stl.h>

#include "errors.h"
#include "strata/core/build_info.h"

namespace strata::python {
namespace {

// Filled by _register_errors; leaked on purpose (the interpreter may be gone
// when static destructors run).
std::map<std::string, py::handle>& error_classes() {
  static auto* classes = new std::map<std::string, py::handle>();
  return *classes;
}

}  // namespace

void raise_status(const Status& status) {
  const std::string code(status_code_name(status.code()));
  auto& classes = error_classes();
  auto it = classes.find(code);
  if (it == classes.end()) it = classes.find("StrataError");
  if (it == classes.end()) throw std::runtime_error(status.to_string());  // before registration
  // A message quotes what users gave (a file's bytes, a path): bytes that are not UTF-8 are shown escaped
  // (\xff), never a UnicodeDecodeError in place of the error.
  const std::string& text = status.message();
  py::object message = py::reinterpret_steal<py::object>(
      PyUnicode_DecodeUTF8(text.data(), static_cast<py::ssize_t>(text.size()), "backslashreplace"));
  if (!message) throw py::error_already_set();
  py::object error = py::reinterpret_borrow<py::object>(it->second)(message);
  error.attr("code") = code;
  PyErr_SetObject(it->second.ptr(), error.ptr());
  throw py::error_already_set();
}

void bind_errors(py::module_& m) {
  m.def(
      "_register_errors",
      [](py::dict classes) {
        for (auto [name, cls] : classes) {
          error_classes()[py::cast<std::string>(name)] = cls.inc_ref();
        }
      },
      "Maps StatusCode names (and 'StrataError', the fallback) to exception classes.");
  m.def("_status_code_names", [] {
    std::vector<std::string> names;
    for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
      names.emplace_back(status_code_name(static_cast<StatusCode>(c)));
    }
    return names;
  });
  // For the error-mapping test: raises the exception of `code` with `message`.
  m.def("_raise_status", [](int code, const std::string& message) {
    raise_status(Status(static_cast<StatusCode>(code), message));
  });
}

}  // namespace strata::python

PYBIND11_MODULE(_native, m) {
  m.doc() = "Strata's native module (bindings over core, cpu_adam, nvme and the engine)";
  strata::python::bind_errors(m);
  strata::python::bind_optim(m);
  strata::python::bind_io(m);
  strata::python::bind_config(m);
  strata::python::bind_engine(m);
  strata::python::bind_fit(m);
  strata::python::bind_lr_schedule(m);
  const strata::BuildInfo& info = strata::build_info();
  m.attr("__version__") = std::string(info.version);
  m.def("build_info", [] {
    const strata::BuildInfo& b = strata::build_info();
    pybind11::dict d;
    d["version"] = std::string(b.version);
    d["build_type"] = std::string(b.build_type);
    d["compiler"] = std::string(b.compiler);
    d["io_uring"] = b.have_uring;
    d["libaio"] = b.have_aio;
    d["sanitized"] = b.sanitized;
    return d;
  });
}
