// The device optimizer's host side: argument checks, the per-step factors
// and the dispatch to the CUDA launcher (cuda/device_adam.cu). The factors
// are derived here, by the host compiler, with the same double expressions
// as cpu_adam's make_factors (cpu_adam/src/optimizer.cpp), so that the kernel
// starts from the very floats the CPU reference uses (docs/device-adam.md).
#include "strata/offload/device_adam.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "cuda/device_adam_kernel.h"
#include "strata/cpu_adam/int8_moments.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::offload {
namespace {

using cpu_adam::OptimizerKind;

Status check_pointer(const void* p, size_t index, const char* field, size_t count) {
  if (p != nullptr) return Status::Ok();
  return InvalidArgument(fmt::format("device_adam: DeviceAdamTensor[{}].{} is null but count = {}", index, field,
                                     count));
}

// A GPU faults on a misaligned element access (a sticky error that ends the
// context), where x86 does not: the check names the pointer instead.
Status check_alignment(const void* p, size_t alignment, size_t index, const char* field, const char* why) {
  if (reinterpret_cast<uintptr_t>(p) % alignment == 0) return Status::Ok();
  return InvalidArgument(fmt::format("device_adam: DeviceAdamTensor[{}].{} is not {}-byte aligned ({})", index,
                                     field, alignment, why));
}

}  // namespace

Status validate_device_adam(const DeviceAdamArgs& args, std::span<const DeviceAdamTensor> tensors) {
  if (args.kind != OptimizerKind::kAdam && args.kind != OptimizerKind::kAdamW) {
    return Unsupported(fmt::format("device_adam: optimizer '{}' has no device kernel (adam and adamw only); "
                                   "use offload_optimizer.device: cpu for it",
                                   cpu_adam::optimizer_kind_name(args.kind)));
  }
  if (args.step < 1) {
    return InvalidArgument(fmt::format("device_adam: step = {}: steps count from 1 (the first update is step 1)",
                                       args.step));
  }
  if (!(std::isfinite(args.loss_scale) && args.loss_scale > 0.0)) {
    return InvalidArgument(fmt::format("device_adam: loss_scale = {} must be finite and > 0 (1 when not scaling)",
                                       args.loss_scale));
  }
  if (!(std::isfinite(args.clip_coefficient) && args.clip_coefficient > 0.0)) {
    return InvalidArgument(fmt::format("device_adam: clip_coefficient = {} must be finite and > 0 (1 when not "
                                       "clipping)", args.clip_coefficient));
  }
  STRATA_RETURN_IF_ERROR(cpu_adam::validate_hyper_params(args.kind, args.hyper));
  if (!is_state_float(args.grad_dtype)) {
    return InvalidArgument(fmt::format("device_adam: grad_dtype = {} is not supported; use fp32, bf16 or fp16",
                                       dtype_name(args.grad_dtype)));
  }
  if (args.moments.blocked()) {
    STRATA_RETURN_IF_ERROR(cpu_adam::validate_moment_block_elements(args.moments.block_elements(),
                                                                    "device_adam: moments' block_elements"));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DeviceAdamTensor& t = tensors[i];
    if (t.count == 0) continue;
    STRATA_RETURN_IF_ERROR(check_pointer(t.params, i, "params", t.count));
    STRATA_RETURN_IF_ERROR(check_pointer(t.grads, i, "grads", t.count));
    STRATA_RETURN_IF_ERROR(check_pointer(t.exp_avg, i, "exp_avg", t.count));
    STRATA_RETURN_IF_ERROR(check_pointer(t.exp_avg_sq, i, "exp_avg_sq", t.count));
    const size_t moment_alignment = args.moments.blocked() ? sizeof(float) : dtype_size(args.moments.element_dtype());
    const char* moment_why = args.moments.blocked() ? "its block scales are fp32" : "its moment elements";
    STRATA_RETURN_IF_ERROR(check_alignment(t.params, sizeof(float), i, "params", "fp32 elements"));
    STRATA_RETURN_IF_ERROR(check_alignment(t.grads, dtype_size(args.grad_dtype), i, "grads", "its grad_dtype elements"));
    STRATA_RETURN_IF_ERROR(check_alignment(t.exp_avg, moment_alignment, i, "exp_avg", moment_why));
    STRATA_RETURN_IF_ERROR(check_alignment(t.exp_avg_sq, moment_alignment, i, "exp_avg_sq", moment_why));
    if (t.param_copy != nullptr)
      STRATA_RETURN_IF_ERROR(check_alignment(t.param_copy, 2, i, "param_copy", "16-bit elements"));
    if (t.param_copy != nullptr && args.param_copy_dtype != DType::kBF16 && args.param_copy_dtype != DType::kF16) {
      return InvalidArgument(fmt::format("device_adam: DeviceAdamTensor[{}] has a param_copy but param_copy_dtype "
                                         "= {}; use bf16 or fp16 (the fp32 params are the master copy)",
                                         i, dtype_name(args.param_copy_dtype)));
    }
  }
  return Status::Ok();
}

#if STRATA_HAVE_CUDA
namespace {

// Validated dtypes only (is_state_float; copies bf16/fp16).
detail::KernelDType kernel_dtype(DType t) {
  if (t == DType::kBF16) return detail::KernelDType::kBF16;
  if (t == DType::kF16) return detail::KernelDType::kF16;
  return detail::KernelDType::kF32;
}

// The scalars cpu_adam derives for the same step (cpu_adam::update_scalars),
// so the device update uses the very bits the CPU paths use.
detail::DeviceAdamFactors make_device_adam_factors(const DeviceAdamArgs& a) {
  cpu_adam::StepArgs args;
  args.step = a.step;
  args.hyper = a.hyper;
  args.loss_scale = a.loss_scale;
  args.clip_coefficient = a.clip_coefficient;
  const cpu_adam::UpdateScalars u = cpu_adam::update_scalars(a.kind, args);
  detail::DeviceAdamFactors f;
  f.grad_multiplier = u.grad_multiplier;
  f.one_minus_beta1 = u.one_minus_beta1;
  f.beta2 = u.beta2;
  f.one_minus_beta2 = u.one_minus_beta2;
  f.eps = u.eps;
  f.weight_decay = u.weight_decay;
  f.decay_factor = u.decay_factor;
  f.neg_step_size = u.neg_step_size;
  f.inv_bias_correction2_sqrt = u.inv_bias_correction2_sqrt;
  f.l2_decay = u.l2_decay ? 1u : 0u;
  f.decoupled_decay = u.decoupled_decay ? 1u : 0u;
  return f;
}

}  // namespace
#endif  // STRATA_HAVE_CUDA

Status load_device_adam_kernels(Stream& stream) {
#if STRATA_HAVE_CUDA
  if (stream.device().caps().backend != "cuda") return Status::Ok();
  const detail::LaunchResult r = detail::load_device_adam_kernels(stream.native_handle());
  if (r.error != detail::LaunchError::kNone)
    return IoError(fmt::format("loading the device optimizer's kernels on {}: {}", stream.device().caps().name,
                               r.message));
#else
  (void)stream;
#endif
  return Status::Ok();
}

bool device_adam_compiled() {
#if STRATA_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

Status device_adam_step(Stream& stream, const DeviceAdamArgs& args, std::span<const DeviceAdamTensor> tensors) {
  STRATA_RETURN_IF_ERROR(validate_device_adam(args, tensors));
  const DeviceCaps& caps = stream.device().caps();
#if STRATA_HAVE_CUDA
  if (caps.backend != "cuda" || stream.native_handle() == nullptr) {
    return Unsupported(fmt::format("device_adam_step: the stream belongs to the '{}' device ({}); the fused Adam "
                                   "kernel runs on cuda streams only (on the cpu device, step with "
                                   "cpu_adam::CpuOptimizer as stream work)", caps.backend, caps.name));
  }
  const cpu_adam::MomentStorage& moments = args.moments;
  std::vector<detail::KernelTensor> kernel_tensors;
  for (const DeviceAdamTensor& t : tensors) {
    if (t.count == 0) continue;
    // The block scales sit behind the codes in the same buffer (only pointer
    // arithmetic: these are device addresses).
    float* m_scales = moments.blocked() ? moments.scales(t.exp_avg, t.count) : nullptr;
    float* v_scales = moments.blocked() ? moments.scales(t.exp_avg_sq, t.count) : nullptr;
    kernel_tensors.push_back({t.params, t.grads, t.exp_avg, t.exp_avg_sq, t.param_copy, m_scales, v_scales,
                              static_cast<unsigned long long>(t.count)});
  }
  if (kernel_tensors.empty()) return Status::Ok();
  const detail::KernelMoments kernel_moments{
      moments.blocked() ? detail::KernelDType::kF32 : kernel_dtype(moments.element_dtype()),
      static_cast<unsigned>(moments.block_elements())};
  const detail::LaunchResult r = detail::launch_device_adam(
      stream.native_handle(), make_device_adam_factors(args), kernel_dtype(args.grad_dtype), kernel_moments,
      kernel_dtype(args.param_copy_dtype), kernel_tensors.data(), kernel_tensors.size());
  switch (r.error) {
    case detail::LaunchError::kNone: return Status::Ok();
    case detail::LaunchError::kOutOfMemory:
      return OutOfMemory(fmt::format("device_adam_step on {}: {} (the kernel's chunk table, {} tensors)", caps.name,
                                     r.message, kernel_tensors.size()));
    case detail::LaunchError::kTooLarge: return InvalidArgument(fmt::format("device_adam_step: {}", r.message));
    case detail::LaunchError::kCuda: break;
  }
  return IoError(fmt::format("device_adam_step on {}: {}", caps.name, r.message));
#else
  return Unsupported(fmt::format("device_adam_step: this build has no CUDA kernel (configured with "
                                 "STRATA_ENABLE_CUDA=OFF or no CUDA toolkit found), so the '{}' stream cannot run "
                                 "the device optimizer; use offload_optimizer.device: cpu", caps.backend));
#endif
}

}  // namespace strata::offload
