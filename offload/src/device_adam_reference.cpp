// The reference of the fused device kernel: the same step over host memory,
// one tensor at a time through cpu_adam's scalar loop (KernelPath::kScalar,
// one thread), the definition the kernel must equal bit for bit
// (tests/offload/device_adam_test.cpp compares them element by element).
#include <algorithm>

#include <fmt/format.h>

#include "strata/cpu_adam/optimizer.h"
#include "strata/offload/device_adam.h"

namespace strata::offload {

Status device_adam_reference(const DeviceAdamArgs& args, std::span<const DeviceAdamTensor> tensors) {
  STRATA_RETURN_IF_ERROR(validate_device_adam(args, tensors));
  // 8-bit moments: tiles of whole blocks (a block must not straddle two tiles).
  const size_t block = args.moments.block_elements();
  const size_t tile = block == 0 ? cpu_adam::OptimizerOptions{}.tile_elements
                                 : block * std::max<size_t>(1, cpu_adam::OptimizerOptions{}.tile_elements / block);
  STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer optimizer,
                          cpu_adam::CpuOptimizer::create({.kind = args.kind,
                                                          .threads = 1,
                                                          .tile_elements = tile,
                                                          .path = cpu_adam::KernelPath::kScalar}));
  cpu_adam::StepArgs step{.step = args.step,
                          .hyper = args.hyper,
                          .loss_scale = args.loss_scale,
                          .clip_coefficient = args.clip_coefficient,
                          .overflow_check = cpu_adam::OverflowCheck::kAssumeFinite};
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DeviceAdamTensor& t = tensors[i];
    if (t.count == 0) continue;
    cpu_adam::StateSpans spans{.count = t.count,
                               .params = t.params,
                               .grads = t.grads,
                               .grad_dtype = args.grad_dtype,
                               .param_copy = t.param_copy,
                               .param_copy_dtype = args.param_copy_dtype};
    args.moments.point(spans, t.exp_avg, t.exp_avg_sq, t.count, 0);
    Result<cpu_adam::StepReport> report = optimizer.step(step, spans);
    if (!report.ok()) {
      return Status(report.status().code(),
                    fmt::format("device_adam_reference: tensor {}: {}", i, report.status().message()));
    }
  }
  return Status::Ok();
}

}  // namespace strata::offload
