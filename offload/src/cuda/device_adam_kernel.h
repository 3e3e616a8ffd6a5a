#pragma once
// Private: the boundary between device_adam.cpp (validation and the per-step
// factors, compiled by the host compiler exactly like cpu_adam's) and the
// CUDA launcher in device_adam.cu. nvcc compiles the project's .cu files as
// C++17 (cmake/StrataDependencies.cmake), so this header includes no core
// header (they are C++20) and carries no CUDA type: plain structs only.

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::offload::detail {

enum class KernelDType : uint8_t { kF32 = 0, kBF16, kF16 };

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

// One tensor as the kernel reads it (device pointers; count > 0).
struct KernelTensor {
  float* params;
  const void* grads;
  void* exp_avg;      // fp32/bf16 values, or 8-bit codes
  void* exp_avg_sq;
  void* param_copy;   // may be null
  float* exp_avg_scale;     // 8-bit moments: one scale per block; else null
  float* exp_avg_sq_scale;
  unsigned long long count;
};

// The moments' storage: block_elements == 0: `dtype` values (fp32, bf16);
// else block-wise 8-bit codes with one fp32 scale per block_elements.
struct KernelMoments {
  KernelDType dtype = KernelDType::kF32;
  unsigned block_elements = 0;
};

enum class LaunchError : uint8_t { kNone = 0, kOutOfMemory, kTooLarge, kCuda };
struct LaunchResult {
  LaunchError error = LaunchError::kNone;
  std::string message;  // what failed, with the CUDA error's name and text
};

// Loads every variant of the kernels now, on `cuda_stream`'s GPU (Note
// [Kernels loaded before any gate] in strata/offload/device_adam.h).
LaunchResult load_device_adam_kernels(void* cuda_stream);

// Enqueues the fused kernel on `cuda_stream` (a cudaStream_t) over
// `tensors[0, tensor_count)`; arguments are already validated.
LaunchResult launch_device_adam(void* cuda_stream, const DeviceAdamFactors& factors, KernelDType grad_dtype,
                                KernelMoments moments, KernelDType param_copy_dtype, const KernelTensor* tensors,
                                size_t tensor_count);

}  // namespace strata::offload::detail
