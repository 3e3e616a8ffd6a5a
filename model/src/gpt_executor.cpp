#include "strata/model/gpt_executor.h"

#include <fmt/format.h>

#include "cpu_backend.h"
#include "executor_impl.h"

#if STRATA_HAVE_CUDA
#include "cuda/cuda_executor.h"
#endif

namespace strata::model {

Result<std::unique_ptr<GptExecutor>> GptExecutor::create(const GptModel& model, Device& device, Stream& stream,
                                                         int batch, int seq_len) {
  const GptConfig& cfg = model.config();
  if (batch < 1 || batch > 65536)
    return InvalidArgument(fmt::format("--batch {} is invalid; use 1..65536", batch));
  if (seq_len < 1 || seq_len > cfg.max_seq_len)
    return InvalidArgument(fmt::format("--seq {} is invalid for preset '{}': use 1..{} (or raise --max-seq)", seq_len,
                                       cfg.preset, cfg.max_seq_len));
  if (&stream.device() != &device)
    return InvalidArgument("executor: the stream belongs to another device; create it with device.create_stream()");
  const std::string& backend = device.caps().backend;
  if (backend == "cuda") {
#if STRATA_HAVE_CUDA
    return detail::make_cuda_executor(model, device, stream, batch, seq_len);
#else
    return Unsupported("--device cuda: this build of the model has no CUDA kernels; rebuild with the CUDA Toolkit");
#endif
  }
  if (backend != "cpu" || !device.caps().host_addressable)
    return Unsupported(fmt::format("executor: no GPT kernels for device backend '{}' (have: cpu, cuda)", backend));
  auto impl = std::make_unique<detail::ExecutorImpl<detail::StreamCpuOps>>(
      model, DeviceKind::kCpu, device, stream, batch, seq_len, std::make_unique<detail::StreamCpuOps>(stream));
  STRATA_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<GptExecutor>(std::move(impl));
}

}  // namespace strata::model
