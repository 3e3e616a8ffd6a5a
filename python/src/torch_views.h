#pragma once
// Engine memory as torch tensors, through DLPack (no link against libtorch:
// the caller hands in torch's own from-DLPack function).
//
// Note [Views through DLPack]
// One DLPack capsule per tensor carries its dtype, shape and strides, so
// torch makes each view in one call (torch.frombuffer makes a flat tensor
// and a reshape is a second call: about twice the time per view in a
// stage-3 acquire, where every acquire builds its views anew). Each view
// holds `keep` (a C++ shared pointer) until torch frees the tensor: the
// last view gone releases it on whatever thread torch frees it, without the
// GIL, so what `keep` owns must not touch Python objects. The memory itself
// is the engine's; a view never frees it.
#include <cstddef>
#include <memory>
#include <vector>

#include <pybind11/pybind11.h>

#include "strata/core/dtype.h"
#include "strata/core/layered_model.h"

namespace strata::python {

namespace py = pybind11;

// Where each tensor of a layer starts and of which dtype: its parameters
// (each tensor's own dtype, at its offset_bytes) or its gradient buffer (one
// dtype for all, at offset_elements).
struct ViewLayout {
  bool gradients = false;
  DType grad_dtype = DType::kF32;  // when `gradients`
};

// Where the viewed memory is: host memory (the cpu device's too) or the
// memory of GPU `ordinal` (the cuda device's, viewed by cuda tensors).
struct ViewDevice {
  bool cuda = false;
  int ordinal = 0;
};

// {name: tensor} over `base`, one tensor per spec, contiguous row-major.
// `from_dlpack` is torch's (torch._C._from_dlpack). `keep` may be null.
py::dict torch_views(const py::object& from_dlpack, std::byte* base, const std::vector<ParamTensorSpec>& tensors,
                     ViewLayout layout, ViewDevice device, const std::shared_ptr<void>& keep);

}  // namespace strata::python
