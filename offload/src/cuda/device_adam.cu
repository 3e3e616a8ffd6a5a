// The fused multi-tensor Adam/AdamW kernel (offload_optimizer.device: none on
// a cuda device). Its reference is cpu_adam's scalar loop; see Note [Exact
// arithmetic] below and docs/device-adam.md.
//
// Note [Chunk table]
// Many tensors of very different sizes (a 1-element bias beside a 50M
// embedding) are stepped by ONE launch: every tensor is cut into chunks of
// kChunkElements, and block b of the grid steps chunk b, found through a
// table of (tensor index, chunk index) pairs; the tensors' pointers sit in
// front of it in the same device allocation. The table is built on the host,
// copied into a stream-ordered allocation (cudaMallocAsync), read by the
// kernel and freed in stream order after it (cudaFreeAsync), so nothing
// synchronizes the host and any number of tensors fits one launch. The copy
// comes from pageable host memory, which CUDA stages before
// cudaMemcpyAsync returns, so the host vector may die right after.
//
// Note [Exact arithmetic]
// Per element the kernel performs exactly the float operations of
// cpu_adam/src/reference.cpp (Note [Update formulas]) in the same order:
// __fmaf_rn wherever the reference calls std::fma, and every other operation
// an explicitly rounded intrinsic (__fmul_rn, __fsub_rn, __fdiv_rn,
// __fsqrt_rn), which the compiler never contracts; the file is also compiled
// with -fmad=false -ftz=false -prec-div=true -prec-sqrt=true
// (offload/CMakeLists.txt). IEEE single precision with round to nearest even
// and subnormals is the same on both sides, so results are bit-identical.
// The bf16/fp16 conversions below repeat core/dtype.h's bit manipulations
// (and its one FPU add for fp16 subnormals) line for line.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "device_adam_kernel.h"

namespace strata::offload::detail {
namespace {

constexpr unsigned kThreads = 256;
constexpr size_t kChunkElements = 16384;  // 64 elements per thread per chunk

struct KernelTensor {
  float* params;
  const void* grads;
  void* exp_avg;
  void* exp_avg_sq;
  void* param_copy;
  unsigned long long count;
};

struct ChunkEntry {
  uint32_t tensor;  // index into the KernelTensor array
  uint32_t chunk;   // chunk number within that tensor
};

// --- conversions: core/dtype.h, on the device ------------------------------

__device__ __forceinline__ float bf16_bits_to_fp32(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

__device__ __forceinline__ uint16_t fp32_to_bf16_bits(float value) {
  const uint32_t x = __float_as_uint(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding_bias) >> 16);
}

__device__ __forceinline__ uint16_t fp32_to_fp16_bits(float value) {
  uint32_t x = __float_as_uint(value);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t out;
  if (x >= 0x47800000u) {
    out = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (x < 0x38800000u) {
    const float sum = __fadd_rn(__uint_as_float(x), __uint_as_float(0x3f000000u));  // + 0.5f
    out = __float_as_uint(sum) - 0x3f000000u;
  } else {
    const uint32_t mantissa_odd = (x >> 13) & 1u;
    x += 0xc8000fffu;
    x += mantissa_odd;
    out = x >> 13;
  }
  return static_cast<uint16_t>(out | sign);
}

__device__ __forceinline__ float fp16_bits_to_fp32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = __fmul_rn(__uint2float_rn(mantissa), 5.9604644775390625e-8f);
    return __uint_as_float(__float_as_uint(magnitude) | sign);
  }
  if (exponent == 31) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

template <DType T>
__device__ __forceinline__ float load(const void* base, size_t i) {
  if constexpr (T == DType::kF32) return static_cast<const float*>(base)[i];
  if constexpr (T == DType::kBF16) return bf16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
  if constexpr (T == DType::kF16) return fp16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
  return 0.0f;
}

template <DType T>
__device__ __forceinline__ void store(void* base, size_t i, float value) {
  if constexpr (T == DType::kF32) static_cast<float*>(base)[i] = value;
  if constexpr (T == DType::kBF16) static_cast<uint16_t*>(base)[i] = fp32_to_bf16_bits(value);
  if constexpr (T == DType::kF16) static_cast<uint16_t*>(base)[i] = fp32_to_fp16_bits(value);
}

// --- the kernel -------------------------------------------------------------

// G: gradient dtype, M: moment dtype, C: copy dtype (used where a tensor has
// a param_copy). One block per chunk (Note [Chunk table]).
template <DType G, DType M, DType C>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(const KernelTensor* __restrict__ tensors, const ChunkEntry* __restrict__ chunks,
                DeviceAdamFactors f) {
  const ChunkEntry entry = chunks[blockIdx.x];
  const KernelTensor t = tensors[entry.tensor];
  const size_t begin = static_cast<size_t>(entry.chunk) * kChunkElements;
  const size_t end = begin + kChunkElements < t.count ? begin + kChunkElements : static_cast<size_t>(t.count);
  for (size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float p = t.params[i];
    float g = __fmul_rn(load<G>(t.grads, i), f.grad_multiplier);
    float m = load<M>(t.exp_avg, i);
    float v = load<M>(t.exp_avg_sq, i);
    if (f.l2_decay) g = __fmaf_rn(f.weight_decay, p, g);
    m = __fmaf_rn(f.one_minus_beta1, __fsub_rn(g, m), m);
    v = __fmaf_rn(__fmul_rn(f.one_minus_beta2, g), g, __fmul_rn(v, f.beta2));
    const float denom = __fmaf_rn(__fsqrt_rn(v), f.inv_bias_correction2_sqrt, f.eps);
    if (f.decoupled_decay) p = __fmul_rn(p, f.decay_factor);
    p = __fmaf_rn(f.neg_step_size, __fdiv_rn(m, denom), p);
    t.params[i] = p;
    store<M>(t.exp_avg, i, m);
    store<M>(t.exp_avg_sq, i, v);
    if (t.param_copy != nullptr) store<C>(t.param_copy, i, p);
  }
}

using KernelFn = void (*)(const KernelTensor*, const ChunkEntry*, DeviceAdamFactors);

template <DType G, DType M>
KernelFn pick_copy(DType c) {
  return c == DType::kF16 ? &adam_kernel<G, M, DType::kF16> : &adam_kernel<G, M, DType::kBF16>;
}
template <DType G>
KernelFn pick_moment(DType m, DType c) {
  return m == DType::kBF16 ? pick_copy<G, DType::kBF16>(c) : pick_copy<G, DType::kF32>(c);
}
KernelFn pick_kernel(DType g, DType m, DType c) {
  if (g == DType::kBF16) return pick_moment<DType::kBF16>(m, c);
  if (g == DType::kF16) return pick_moment<DType::kF16>(m, c);
  return pick_moment<DType::kF32>(m, c);
}

Status cuda_error(cudaError_t err, const char* call) {
  std::string text = std::string("device_adam_step: ") + call + " failed: " + cudaGetErrorName(err) + " (" +
                     cudaGetErrorString(err) + ")";
  if (err == cudaErrorMemoryAllocation) return OutOfMemory(text + "; the chunk table could not be allocated");
  return IoError(std::move(text));
}

// Launches on the stream's own GPU: a stream of cuda:1 must not meet a
// thread whose current device is cuda:0. Restores the caller's device.
class StreamDeviceGuard {
 public:
  Status enter(cudaStream_t stream) {
    int stream_device = 0;
    cudaError_t err = cudaStreamGetDevice(stream, &stream_device);
    if (err != cudaSuccess) return cuda_error(err, "cudaStreamGetDevice");
    err = cudaGetDevice(&previous_);
    if (err != cudaSuccess) return cuda_error(err, "cudaGetDevice");
    if (previous_ == stream_device) return Status::Ok();
    err = cudaSetDevice(stream_device);
    if (err != cudaSuccess) return cuda_error(err, "cudaSetDevice");
    switched_ = true;
    return Status::Ok();
  }
  ~StreamDeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace

Status launch_device_adam(void* cuda_stream, const DeviceAdamFactors& factors, DType grad_dtype,
                          DType moment_dtype, DType param_copy_dtype, std::span<const DeviceAdamTensor> tensors) {
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  std::vector<KernelTensor> kernel_tensors;
  std::vector<ChunkEntry> chunks;
  for (const DeviceAdamTensor& t : tensors) {
    if (t.count == 0) continue;
    const size_t tensor_chunks = (t.count + kChunkElements - 1) / kChunkElements;
    if (tensor_chunks > UINT32_MAX || kernel_tensors.size() >= UINT32_MAX) {
      return InvalidArgument("device_adam_step: a tensor of " + std::to_string(t.count) +
                             " elements exceeds the chunk table's 2^32 chunks of " +
                             std::to_string(kChunkElements));
    }
    const auto index = static_cast<uint32_t>(kernel_tensors.size());
    kernel_tensors.push_back({t.params, t.grads, t.exp_avg, t.exp_avg_sq, t.param_copy,
                              static_cast<unsigned long long>(t.count)});
    for (size_t c = 0; c < tensor_chunks; ++c) chunks.push_back({index, static_cast<uint32_t>(c)});
  }
  if (chunks.empty()) return Status::Ok();
  if (chunks.size() > 0x7fffffffu) {
    return InvalidArgument("device_adam_step: " + std::to_string(chunks.size()) +
                           " chunks exceed one grid (2^31 - 1 blocks); split the step");
  }
  // One allocation: the tensors, then the chunk entries (both 8-byte aligned).
  const size_t tensor_bytes = kernel_tensors.size() * sizeof(KernelTensor);
  const size_t table_bytes = tensor_bytes + chunks.size() * sizeof(ChunkEntry);
  std::vector<unsigned char> host(table_bytes);
  std::memcpy(host.data(), kernel_tensors.data(), tensor_bytes);
  std::memcpy(host.data() + tensor_bytes, chunks.data(), chunks.size() * sizeof(ChunkEntry));

  StreamDeviceGuard guard;
  STRATA_RETURN_IF_ERROR(guard.enter(stream));
  void* table = nullptr;
  cudaError_t err = cudaMallocAsync(&table, table_bytes, stream);
  if (err != cudaSuccess) return cuda_error(err, "cudaMallocAsync (chunk table)");
  err = cudaMemcpyAsync(table, host.data(), table_bytes, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    const auto* kt = static_cast<const KernelTensor*>(table);
    const auto* ct = reinterpret_cast<const ChunkEntry*>(static_cast<const unsigned char*>(table) + tensor_bytes);
    pick_kernel(grad_dtype, moment_dtype, param_copy_dtype)<<<static_cast<unsigned>(chunks.size()), kThreads, 0,
                                                               stream>>>(kt, ct, factors);
    err = cudaGetLastError();
    if (err != cudaSuccess) {
      cudaFreeAsync(table, stream);
      return cuda_error(err, "adam_kernel launch");
    }
  } else {
    cudaFreeAsync(table, stream);
    return cuda_error(err, "cudaMemcpyAsync (chunk table)");
  }
  err = cudaFreeAsync(table, stream);
  if (err != cudaSuccess) return cuda_error(err, "cudaFreeAsync (chunk table)");
  return Status::Ok();
}

}  // namespace strata::offload::detail
