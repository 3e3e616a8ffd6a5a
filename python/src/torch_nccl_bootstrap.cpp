// Note [NCCL for torch ranks] (torch_nccl_bootstrap.h).
#include "torch_nccl_bootstrap.h"

#include <fmt/format.h>
#include <pybind11/pybind11.h>

#include "strata/comm/backends.h"

namespace strata::python {

namespace py = pybind11;

Status torch_broadcast_bytes(std::span<std::byte> bytes, int root, const comm::CommOptions& options) {
  try {
    py::module_ torch = py::module_::import("torch");
    py::module_ dist = py::module_::import("torch.distributed");
    if (!dist.attr("is_available")().cast<bool>() || !dist.attr("is_initialized")().cast<bool>())
      return FailedPrecondition("sharing NCCL's unique ids: torch.distributed is not initialized");
    const auto ms = options.timeout.count() > 0 ? options.timeout.count() : comm::kMaxCommTimeout.count();
    const py::object timeout = py::module_::import("datetime").attr("timedelta")(py::arg("milliseconds") = ms);
    py::object group = dist.attr("new_group")(py::arg("timeout") = timeout, py::arg("backend") = "gloo");
    auto view = py::memoryview::from_memory(static_cast<void*>(bytes.data()), static_cast<py::ssize_t>(bytes.size()),
                                            /*readonly=*/false);
    py::object tensor = torch.attr("frombuffer")(view, py::arg("dtype") = torch.attr("uint8"));
    dist.attr("broadcast")(tensor, root, py::arg("group") = group);
    dist.attr("destroy_process_group")(group);
    return Status::Ok();
  } catch (py::error_already_set& e) {
    return Unavailable(fmt::format("sharing NCCL's unique ids over torch.distributed (a gloo group) failed: {}",
                                   e.what()));
  }
}

Result<std::unique_ptr<comm::Communicator>> create_nccl_for_torch_ranks(Device& device, int ordinal,
                                                                          const comm::CommOptions& options) {
  comm::NcclOptions nccl;
  nccl.common = options;
  nccl.device = ordinal;
  nccl.cuda_device = &device;
  try {
    py::module_ dist = py::module_::import("torch.distributed");
    nccl.rank = dist.attr("get_rank")().cast<int>();
    nccl.world_size = dist.attr("get_world_size")().cast<int>();
  } catch (py::error_already_set& e) {
    return Unavailable(fmt::format("the GPU ranks' NCCL communicator: torch.distributed's rank: {}", e.what()));
  }
  nccl.share_ids = [options](std::span<std::byte> ids) { return torch_broadcast_bytes(ids, 0, options); };
  Result<std::unique_ptr<comm::Communicator>> made = comm::create_nccl_communicator(std::move(nccl));
  if (!made.ok())
    return made.status().with_context(fmt::format("the engine's NCCL communicator on cuda:{} for torch.distributed's "
                                                  "ranks (Note [NCCL for torch ranks])",
                                                  ordinal));
  return made;
}

}  // namespace strata::python
