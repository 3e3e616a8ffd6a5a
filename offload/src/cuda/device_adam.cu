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

template <KernelDType T>
__device__ __forceinline__ float load(const void* base, size_t i) {
  if constexpr (T == KernelDType::kF32) return static_cast<const float*>(base)[i];
  if constexpr (T == KernelDType::kBF16) return bf16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
  if constexpr (T == KernelDType::kF16) return fp16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
  return 0.0f;
}

template <KernelDType T>
__device__ __forceinline__ void store(void* base, size_t i, float value) {
  if constexpr (T == KernelDType::kF32) static_cast<float*>(base)[i] = value;
  if constexpr (T == KernelDType::kBF16) static_cast<uint16_t*>(base)[i] = fp32_to_bf16_bits(value);
  if constexpr (T == KernelDType::kF16) static_cast<uint16_t*>(base)[i] = fp32_to_fp16_bits(value);
}

// --- the kernel -------------------------------------------------------------

// G: gradient dtype, M: moment dtype, C: copy dtype (used where a tensor has
// a param_copy). One block per chunk (Note [Chunk table]).
template <KernelDType G, KernelDType M, KernelDType C>
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

template <KernelDType G, KernelDType M>
KernelFn pick_copy(KernelDType c) {
  return c == KernelDType::kF16 ? &adam_kernel<G, M, KernelDType::kF16> : &adam_kernel<G, M, KernelDType::kBF16>;
}
template <KernelDType G>
KernelFn pick_moment(KernelDType m, KernelDType c) {
  return m == KernelDType::kBF16 ? pick_copy<G, KernelDType::kBF16>(c) : pick_copy<G, KernelDType::kF32>(c);
}
KernelFn pick_kernel(KernelDType g, KernelDType m, KernelDType c) {
  if (g == KernelDType::kBF16) return pick_moment<KernelDType::kBF16>(m, c);
  if (g == KernelDType::kF16) return pick_moment<KernelDType::kF16>(m, c);
  return pick_moment<KernelDType::kF32>(m, c);
}

LaunchResult cuda_error(cudaError_t err, const char* call) {
  LaunchResult r;
  r.error = err == cudaErrorMemoryAllocation ? LaunchError::kOutOfMemory : LaunchError::kCuda;
  r.message = std::string(call) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  return r;
}

// Launches on the stream's own GPU: a stream of cuda:1 must not meet a
// thread whose current device is cuda:0. Restores the caller's device.
class StreamDeviceGuard {
 public:
  LaunchResult enter(cudaStream_t stream) {
    int stream_device = 0;
    cudaError_t err = cudaStreamGetDevice(stream, &stream_device);
    if (err != cudaSuccess) return cuda_error(err, "cudaStreamGetDevice");
    err = cudaGetDevice(&previous_);
    if (err != cudaSuccess) return cuda_error(err, "cudaGetDevice");
    if (previous_ == stream_device) return {};
    err = cudaSetDevice(stream_device);
    if (err != cudaSuccess) return cuda_error(err, "cudaSetDevice");
    switched_ = true;
    return {};
  }
  ~StreamDeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace

LaunchResult launch_device_adam(void* cuda_stream, const DeviceAdamFactors& factors, KernelDType grad_dtype,
                                KernelDType moment_dtype, KernelDType param_copy_dtype, const KernelTensor* tensors,
                                size_t tensor_count) {
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  std::vector<ChunkEntry> chunks;
  for (size_t index = 0; index < tensor_count; ++index) {
    const size_t tensor_chunks = (tensors[index].count + kChunkElements - 1) / kChunkElements;
    if (tensor_chunks > UINT32_MAX || index > UINT32_MAX) {
      return {LaunchError::kTooLarge, "tensor " + std::to_string(index) + " of " +
                                          std::to_string(tensors[index].count) + " elements exceeds the chunk "
                                          "table's 2^32 chunks of " + std::to_string(kChunkElements)};
    }
    for (size_t c = 0; c < tensor_chunks; ++c) {
      chunks.push_back({static_cast<uint32_t>(index), static_cast<uint32_t>(c)});
    }
  }
  if (chunks.empty()) return {};
  if (chunks.size() > 0x7fffffffu) {
    return {LaunchError::kTooLarge, std::to_string(chunks.size()) +
                                        " chunks exceed one grid (2^31 - 1 blocks); split the step"};
  }
  // One allocation: the tensors, then the chunk entries (both 8-byte aligned).
  const size_t tensor_bytes = tensor_count * sizeof(KernelTensor);
  const size_t table_bytes = tensor_bytes + chunks.size() * sizeof(ChunkEntry);
  std::vector<unsigned char> host(table_bytes);
  std::memcpy(host.data(), tensors, tensor_bytes);
  std::memcpy(host.data() + tensor_bytes, chunks.data(), chunks.size() * sizeof(ChunkEntry));

  StreamDeviceGuard guard;
  if (LaunchResult r = guard.enter(stream); r.error != LaunchError::kNone) return r;
  void* table = nullptr;
  cudaError_t err = cudaMallocAsync(&table, table_bytes, stream);
  if (err != cudaSuccess) return cuda_error(err, "cudaMallocAsync (chunk table)");
  err = cudaMemcpyAsync(table, host.data(), table_bytes, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) {
    cudaFreeAsync(table, stream);
    return cuda_error(err, "cudaMemcpyAsync (chunk table)");
  }
  const auto* kt = static_cast<const KernelTensor*>(table);
  const auto* ct = reinterpret_cast<const ChunkEntry*>(static_cast<const unsigned char*>(table) + tensor_bytes);
  pick_kernel(grad_dtype, moment_dtype, param_copy_dtype)<<<static_cast<unsigned>(chunks.size()), kThreads, 0,
                                                             stream>>>(kt, ct, factors);
  err = cudaGetLastError();
  if (err != cudaSuccess) {
    cudaFreeAsync(table, stream);
    return cuda_error(err, "adam_kernel launch");
  }
  err = cudaFreeAsync(table, stream);
  if (err != cudaSuccess) return cuda_error(err, "cudaFreeAsync (chunk table)");
  return {};
}

}  // namespace strata::offload::detail
