#pragma once
// The interpreter's state as native code needs it.
#include <pybind11/pybind11.h>

namespace strata::python {

// True once the interpreter is finalizing: a thread that waits for the GIL
// then is ended by CPython (its C++ frames never unwind cleanly), so native
// code neither gives the GIL up nor takes it from then on.
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

}  // namespace strata::python
