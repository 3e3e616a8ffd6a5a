#include "cuda_executor.h"

#include <cuda_runtime.h>

#include "cuda_ops.h"
#include "strata/core/status.h"

namespace strata::model::detail {
Status ops_status(const CudaOps& ops) { return ops.ok() ? Status::Ok() : Internal(ops.error()); }
}  // namespace strata::model::detail

#include "../executor_impl.h"

namespace strata::model::detail {

bool cuda_probe(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    if (why != nullptr) *why = "no CUDA device found";
    return false;
  }
  return true;
}

Result<std::unique_ptr<GptExecutor>> make_cuda_executor(const GptModel& model, int batch, int seq_len,
                                                        uint64_t device_capacity_bytes) {
  std::string why;
  if (!cuda_probe(&why))
    return Unavailable(fmt::format("--device cuda: no usable GPU ({}); use --device cpu", why));
  auto ops = std::make_unique<CudaOps>();
  STRATA_RETURN_IF_ERROR(ops_status(*ops));
  auto alloc = std::make_unique<CountingAllocator<CudaOps>>(*ops, device_capacity_bytes);
  auto impl = std::make_unique<ExecutorImpl<CudaOps>>(model, DeviceKind::kCuda, batch, seq_len, std::move(ops),
                                                      std::move(alloc));
  STRATA_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<GptExecutor>(std::move(impl));
}

}  // namespace strata::model::detail
