// Engine memory as torch tensors through DLPack (Note [Views through DLPack],
// torch_views.h).
#include "torch_views.h"

#include <cstdint>
#include <stdexcept>

#include <fmt/format.h>

namespace strata::python {
namespace {

// The DLPack ABI (dmlc/dlpack, version 0.x: what torch 1.13 and 2.x read
// from a capsule named "dltensor"), declared here rather than taken from a
// header: only these plain C structs are exchanged.
enum DLDeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2 };
enum DLDataTypeCode : uint8_t { kDLFloat = 2, kDLBfloat = 4 };
struct DLDevice {
  DLDeviceType device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// One view: the DLPack record, its shape and strides, and what it keeps.
struct View {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::shared_ptr<void> keep;
};

void delete_view(DLManagedTensor* managed) { delete static_cast<View*>(managed->manager_ctx); }

// A capsule torch did not take (its from_dlpack raised) still owns its view.
void delete_unused_capsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;  // torch renamed it "used_dltensor": torch owns it
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr) managed->deleter(managed);
}

DLDataType dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return {kDLFloat, 32, 1};
    case DType::kF16: return {kDLFloat, 16, 1};
    case DType::kBF16: return {kDLBfloat, 16, 1};
    default: break;
  }
  throw std::invalid_argument(fmt::format("no torch view of dtype {}", dtype_name(dtype)));
}

}  // namespace

py::dict torch_views(const py::object& from_dlpack, std::byte* base, const std::vector<ParamTensorSpec>& tensors,
                     ViewLayout layout, ViewDevice device, const std::shared_ptr<void>& keep) {
  py::dict views;
  for (const ParamTensorSpec& t : tensors) {
    const DType dtype = layout.gradients ? layout.grad_dtype : t.dtype;
    const size_t offset = layout.gradients ? t.offset_elements * dtype_size(dtype) : t.offset_bytes;
    auto view = std::make_unique<View>();
    view->shape = t.shape;
    view->strides.assign(t.shape.size(), 1);
    for (size_t d = t.shape.size(); d-- > 1;) view->strides[d - 1] = view->strides[d] * t.shape[d];
    view->keep = keep;
    DLTensor& dl = view->managed.dl_tensor;
    dl.data = base + offset;
    dl.device = device.cuda ? DLDevice{kDLCUDA, device.ordinal} : DLDevice{kDLCPU, 0};
    dl.ndim = static_cast<int32_t>(t.shape.size());
    dl.dtype = dlpack_dtype(dtype);
    dl.shape = view->shape.data();
    dl.strides = view->strides.data();
    dl.byte_offset = 0;
    view->managed.manager_ctx = view.get();
    view->managed.deleter = delete_view;
    py::capsule capsule(&view.release()->managed, "dltensor", delete_unused_capsule);
    views[py::str(t.name)] = from_dlpack(capsule);
  }
  return views;
}

}  // namespace strata::python
