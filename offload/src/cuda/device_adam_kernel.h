#pragma once
// Private: the boundary between device_adam.cpp (validation and the per-step
// factors, compiled by the host compiler exactly like cpu_adam's) and the
// CUDA launcher in device_adam.cu. No CUDA types, so both sides include it.

#include <cstddef>
#include <cstdint>
#include <span>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/offload/device_adam.h"

namespace strata::offload::detail {

// Per-step float factors, derived in double and rounded to float once, the
// same derivation as cpu_adam's make_factors (optimizer.cpp) for Adam/AdamW.
struct DeviceAdamFactors {
  float grad_multiplier = 1.0f;            // clip_coefficient / loss_scale
  float one_minus_beta1 = 0.0f;
  float beta2 = 0.0f;
  float one_minus_beta2 = 0.0f;
  float eps = 0.0f;
  float weight_decay = 0.0f;               // Adam: L2 on the gradient
  float decay_factor = 1.0f;               // AdamW: 1 - lr * weight_decay
  float neg_step_size = 0.0f;              // -lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt = 1.0f;  // 1 / sqrt(1 - beta2^t)
  uint32_t l2_decay = 0;                   // Adam with weight_decay != 0
  uint32_t decoupled_decay = 0;            // AdamW with weight_decay != 0
};

DeviceAdamFactors make_device_adam_factors(const DeviceAdamArgs& args);

// Enqueues the fused kernel on `cuda_stream` (a cudaStream_t) over the
// tensors with count > 0; arguments are already validated.
Status launch_device_adam(void* cuda_stream, const DeviceAdamFactors& factors, DType grad_dtype,
                          DType moment_dtype, DType param_copy_dtype, std::span<const DeviceAdamTensor> tensors);

}  // namespace strata::offload::detail
