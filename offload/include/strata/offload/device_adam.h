#pragma once
// The device optimizer: one Adam/AdamW step over many tensors of training
// state that live in cuda device memory, as ONE fused kernel launched in a
// stream's order (offload_optimizer.device: none on a cuda device).
//
//   DeviceAdamArgs a{.kind = OptimizerKind::kAdamW, .hyper = {.lr = 1e-4, .weight_decay = 0.01},
//                    .step = t, .clip_coefficient = clip, .loss_scale = scale,
//                    .grad_dtype = DType::kBF16, .param_copy_dtype = DType::kBF16};
//   std::vector<DeviceAdamTensor> ts = {{master0, grad0, m0, v0, bf16_param0, n0}, ...};
//   STRATA_RETURN_IF_ERROR(device_adam_step(stream, a, ts));  // enqueued; record an event after it
//
// Arithmetic (the bit-identity claim): per element the kernel performs the
// float operations of cpu_adam's scalar reference (Note [Update formulas] in
// cpu_adam/src/reference.cpp) in the same order, fusing exactly the same
// multiply-adds (__fmaf_rn where the reference calls std::fma, every other
// operation an explicitly rounded __fmul_rn / __fsub_rn / __fdiv_rn /
// __fsqrt_rn, compiled with -fmad=false -ftz=false), from per-step factors
// derived in double and rounded to float exactly as CpuOptimizer derives
// them; bf16/fp16 loads and stores repeat core/dtype.h's conversions bit for
// bit. So the master weights, both moments (fp32, bf16 or block-wise 8-bit
// codes and scales) and the bf16/fp16 parameter copy equal
// device_adam_reference()'s (the scalar CpuOptimizer path) bit for bit, for
// every dtype mix, on finite gradients. 8-bit moments (args.moments =
// MomentStorage::int8(B), Adam/AdamW): one thread block steps a block of B
// elements, keeps its new m and sqrt(v) in shared memory, takes the block's
// maxima as the new scales and encodes, with cpu_adam's integer and float
// operations (Note [Block-wise 8-bit moments]).
// Overflow: the kernel does not look for Inf/NaN; the engine decides the
// overflow vote before it steps (a skipped step launches nothing).
//
// No CUDA type appears here: this header builds everywhere. The tensors'
// pointers are device pointers for device_adam_step and host pointers for
// device_adam_reference.

#include <cstddef>
#include <cstdint>
#include <span>

#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/hyper_params.h"
#include "strata/cpu_adam/moment_storage.h"

namespace strata::offload {

// One tensor of state, `count` elements in every stream. A tensor with
// count 0 is skipped and may hold null pointers.
struct DeviceAdamTensor {
  float* params = nullptr;        // fp32 master weights, updated in place
  const void* grads = nullptr;    // args.grad_dtype, read only
  // Each a moment buffer in args.moments' layout (MomentStorage::moment_bytes(count)
  // bytes; int8: the codes, padded to 64 bytes, then the block scales).
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* param_copy = nullptr;     // optional: the updated params in args.param_copy_dtype
  size_t count = 0;
};

struct DeviceAdamArgs {
  cpu_adam::OptimizerKind kind = cpu_adam::OptimizerKind::kAdamW;  // kAdam or kAdamW
  cpu_adam::HyperParams hyper;
  int64_t step = 1;                // 1-based; bias correction uses beta^step
  // The optimizer sees g * (clip_coefficient / loss_scale), as in cpu_adam::StepArgs.
  double clip_coefficient = 1.0;
  double loss_scale = 1.0;
  DType grad_dtype = DType::kF32;         // fp32, bf16 or fp16
  cpu_adam::MomentStorage moments = cpu_adam::MomentStorage::fp32();  // fp32, bf16 or int8 (both moments)
  DType param_copy_dtype = DType::kBF16;  // bf16 or fp16; used by tensors with a param_copy
};

// Checks what both entry points need: kind (Lion/Adagrad: Unsupported),
// step, scales, hyper-parameters, dtypes, the 8-bit block size, and every tensor's pointers
// (InvalidArgument naming the field and the tensor index).
Status validate_device_adam(const DeviceAdamArgs& args, std::span<const DeviceAdamTensor> tensors);

// Enqueues one fused multi-tensor step on `stream` (a cuda stream) and
// returns; the state is final once later work on the stream may run.
// Unsupported, naming why, on a non-cuda stream or in a build without CUDA;
// a launch failure is an IoError naming the CUDA error.
Status device_adam_step(Stream& stream, const DeviceAdamArgs& args, std::span<const DeviceAdamTensor> tensors);

// The reference the kernel is tested against: the same step over host
// memory, tensor by tensor, through cpu_adam::CpuOptimizer's scalar path
// (one thread, gradients assumed finite). Synchronous.
Status device_adam_reference(const DeviceAdamArgs& args, std::span<const DeviceAdamTensor> tensors);

// Note [Kernels loaded before any gate]
// CUDA loads a kernel at its first launch by default (lazy loading,
// CUDA_MODULE_LOADING=LAZY), and loading may wait for the whole device to
// go idle. A stream parked on a gate (Stream::wait(const Completion&))
// waits for host code, so a first launch made while one is parked can wait
// forever for host code that is itself waiting on this thread: measured on
// an H200, the engine hung in its second step inside the optimizer
// thread's first launch of a kernel variant while the model stream was
// gated on that layer's update. So the kernels are loaded up front, before
// any stream is gated: load_device_adam_kernels(stream) loads every variant
// of the fused kernels on the stream's GPU (a no-op for a stream of another
// backend, or without CUDA). The engine calls it when it creates the device
// optimizer; a caller of device_adam_step() that gates streams should call
// it once first.
Status load_device_adam_kernels(Stream& stream);

// True when this build contains the CUDA kernel (it may still find no GPU).
bool device_adam_compiled();

}  // namespace strata::offload
