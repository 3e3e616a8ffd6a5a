// The fused multi-tensor Adam/AdamW kernel (offload_optimizer.device: none on
// a cuda device). Its reference is cpu_adam's scalar loop; see Note [Exact
// arithmetic] below and docs/device-adam.md.
//
// Note [Chunk table]
// Many tensors of very different sizes (a 1-element bias beside a 50M
// embedding) are stepped by ONE launch: every tensor is cut into chunks of
// kChunkElements (8-bit moments: of whole moment blocks), and block b of the
// grid steps chunk b, found through a table of (tensor index, chunk index) pairs; the tensors' pointers sit in
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

// --- 8-bit moments: cpu_adam/src/int8_format.h, on the device --------------
//
// Note [Block-wise 8-bit moments] (cpu_adam/src/int8_moments.cpp): per block
// of B elements one fp32 scale per moment (the largest |m|, the largest
// u = sqrt(v)), per element a code: m as sign << 7 | E4M3(|m| / scale),
// sqrt(v) as E4M4(u / scale). Decoding and encoding repeat int8_format.h's
// integer and float operations (Note [Codes from fp32's lowest binades]:
// the code is the integer rounding of the bits of r * 2^-112, a subnormal
// product below 2^-14, which -ftz=false keeps), so codes and scales equal
// the CPU reference's bit for bit.

template <int M>
__device__ __forceinline__ float decode_magnitude(uint32_t q) {
  if (q >= (1u << M)) return __uint_as_float((q + (112u << M)) << (23 - M));
  return __fmul_rn(__int2float_rn(static_cast<int>(q)), 1.0f / static_cast<float>(1u << (14 + M)));
}

template <int M>
__device__ __forceinline__ uint32_t encode_magnitude(float r) {
  const uint32_t a = __float_as_uint(__fmul_rn(r, 0x1p-112f)) & 0x7fffffffu;
  const uint32_t q = (a + (1u << (22 - M))) >> (23 - M);  // to nearest, a midpoint up
  return q < (15u << M) ? q : (15u << M);
}

__device__ __forceinline__ float decode_exp_avg(uint8_t code, float scale) {
  const float magnitude = decode_magnitude<3>(code & 0x7fu);
  return __fmul_rn(__uint_as_float(__float_as_uint(magnitude) | (static_cast<uint32_t>(code & 0x80u) << 24)), scale);
}
__device__ __forceinline__ uint8_t encode_exp_avg(float m, float inv_scale) {
  const uint32_t sign = (__float_as_uint(m) >> 24) & 0x80u;
  return static_cast<uint8_t>(sign | encode_magnitude<3>(__fmul_rn(m, inv_scale)));
}
__device__ __forceinline__ float decode_exp_avg_sq_root(uint8_t code, float scale) {
  return __fmul_rn(decode_magnitude<4>(code), scale);
}
__device__ __forceinline__ uint8_t encode_exp_avg_sq_root(float u, float inv_scale) {
  return static_cast<uint8_t>(encode_magnitude<4>(__fmul_rn(u, inv_scale)));
}
__device__ __forceinline__ float inverse_scale(float scale) { return scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f; }

// The largest of every thread's value in the block (exact: unsigned max).
__device__ __forceinline__ uint32_t block_max(uint32_t x, uint32_t* warp_maxima) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = other > x ? other : x;
  }
  if (threadIdx.x % 32 == 0) warp_maxima[threadIdx.x / 32] = x;
  __syncthreads();
  uint32_t m = 0;
  for (unsigned w = 0; w < kThreads / 32; ++w) m = warp_maxima[w] > m ? warp_maxima[w] : m;
  return m;
}

// G: gradient dtype, C: copy dtype. One block per chunk of whole moment
// blocks (Note [Chunk table]); per moment block: update, keep m and u in
// shared memory (2 * block_elements floats, dynamic), take the maxima,
// encode. The CPU reference's order per element (reference.cpp's
// adam_update_int8).
template <KernelDType G, KernelDType C>
__global__ void __launch_bounds__(kThreads)
    adam_int8_kernel(const KernelTensor* __restrict__ tensors, const ChunkEntry* __restrict__ chunks,
                     DeviceAdamFactors f, unsigned block_elements, unsigned chunk_elements) {
  extern __shared__ float moment_buffers[];
  __shared__ uint32_t warp_maxima[2][kThreads / 32];
  float* const m_new = moment_buffers;
  float* const u_new = moment_buffers + block_elements;
  const ChunkEntry entry = chunks[blockIdx.x];
  const KernelTensor t = tensors[entry.tensor];
  auto* const m_codes = static_cast<uint8_t*>(t.exp_avg);
  auto* const v_codes = static_cast<uint8_t*>(t.exp_avg_sq);
  const size_t chunk_begin = static_cast<size_t>(entry.chunk) * chunk_elements;
  const size_t chunk_end =
      chunk_begin + chunk_elements < t.count ? chunk_begin + chunk_elements : static_cast<size_t>(t.count);
  for (size_t begin = chunk_begin; begin < chunk_end; begin += block_elements) {
    const size_t n = begin + block_elements < chunk_end ? block_elements : chunk_end - begin;
    const size_t block = begin / block_elements;
    const float m_scale = t.exp_avg_scale[block], u_scale = t.exp_avg_sq_scale[block];
    uint32_t m_max = 0, u_max = 0;
    for (size_t j = threadIdx.x; j < n; j += kThreads) {
      const size_t i = begin + j;
      float p = t.params[i];
      float g = __fmul_rn(load<G>(t.grads, i), f.grad_multiplier);
      float m = decode_exp_avg(m_codes[i], m_scale);
      const float u_old = decode_exp_avg_sq_root(v_codes[i], u_scale);
      float v = __fmul_rn(u_old, u_old);
      if (f.l2_decay) g = __fmaf_rn(f.weight_decay, p, g);
      m = __fmaf_rn(f.one_minus_beta1, __fsub_rn(g, m), m);
      v = __fmaf_rn(__fmul_rn(f.one_minus_beta2, g), g, __fmul_rn(v, f.beta2));
      const float u = __fsqrt_rn(v);
      const float denom = __fmaf_rn(u, f.inv_bias_correction2_sqrt, f.eps);
      if (f.decoupled_decay) p = __fmul_rn(p, f.decay_factor);
      p = __fmaf_rn(f.neg_step_size, __fdiv_rn(m, denom), p);
      t.params[i] = p;
      if (t.param_copy != nullptr) store<C>(t.param_copy, i, p);
      m_new[j] = m;
      u_new[j] = u;
      const uint32_t m_bits = __float_as_uint(m) & 0x7fffffffu, u_bits = __float_as_uint(u) & 0x7fffffffu;
      m_max = m_bits > m_max ? m_bits : m_max;
      u_max = u_bits > u_max ? u_bits : u_max;
    }
    // Every thread has read this block's old scales and written its buffer
    // entries before the first barrier in block_max.
    const float m_scale_new = __uint_as_float(block_max(m_max, warp_maxima[0]));
    const float u_scale_new = __uint_as_float(block_max(u_max, warp_maxima[1]));
    const float m_inv = inverse_scale(m_scale_new), u_inv = inverse_scale(u_scale_new);
    for (size_t j = threadIdx.x; j < n; j += kThreads) {
      m_codes[begin + j] = encode_exp_avg(m_new[j], m_inv);
      v_codes[begin + j] = encode_exp_avg_sq_root(u_new[j], u_inv);
    }
    if (threadIdx.x == 0) {
      t.exp_avg_scale[block] = m_scale_new;
      t.exp_avg_sq_scale[block] = u_scale_new;
    }
    __syncthreads();  // the buffers and warp maxima are reused by the next block
  }
}

using Int8KernelFn = void (*)(const KernelTensor*, const ChunkEntry*, DeviceAdamFactors, unsigned, unsigned);

Int8KernelFn pick_int8_kernel(KernelDType g, KernelDType c) {
  const bool f16_copy = c == KernelDType::kF16;
  if (g == KernelDType::kBF16) {
    return f16_copy ? &adam_int8_kernel<KernelDType::kBF16, KernelDType::kF16>
                    : &adam_int8_kernel<KernelDType::kBF16, KernelDType::kBF16>;
  }
  if (g == KernelDType::kF16) {
    return f16_copy ? &adam_int8_kernel<KernelDType::kF16, KernelDType::kF16>
                    : &adam_int8_kernel<KernelDType::kF16, KernelDType::kBF16>;
  }
  return f16_copy ? &adam_int8_kernel<KernelDType::kF32, KernelDType::kF16>
                  : &adam_int8_kernel<KernelDType::kF32, KernelDType::kBF16>;
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

LaunchResult load_device_adam_kernels(void* cuda_stream) {
  StreamDeviceGuard guard;  // kernels load into the stream's GPU's context
  if (LaunchResult r = guard.enter(static_cast<cudaStream_t>(cuda_stream)); r.error != LaunchError::kNone) return r;
  constexpr KernelDType kGrads[] = {KernelDType::kF32, KernelDType::kBF16, KernelDType::kF16};
  constexpr KernelDType kMoments[] = {KernelDType::kF32, KernelDType::kBF16};
  constexpr KernelDType kCopies[] = {KernelDType::kF16, KernelDType::kBF16};
  cudaFuncAttributes attributes{};
  for (KernelDType g : kGrads) {
    for (KernelDType c : kCopies) {
      for (KernelDType m : kMoments) {
        const cudaError_t err = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(pick_kernel(g, m, c)));
        if (err != cudaSuccess) return cuda_error(err, "cudaFuncGetAttributes (adam_kernel)");
      }
      const cudaError_t err = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(pick_int8_kernel(g, c)));
      if (err != cudaSuccess) return cuda_error(err, "cudaFuncGetAttributes (adam_int8_kernel)");
    }
  }
  return {};
}

LaunchResult launch_device_adam(void* cuda_stream, const DeviceAdamFactors& factors, KernelDType grad_dtype,
                                KernelMoments moments, KernelDType param_copy_dtype, const KernelTensor* tensors,
                                size_t tensor_count) {
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  // 8-bit moments: chunks of whole moment blocks (B divides no power of two
  // when it is, say, 192), about kChunkElements each.
  const unsigned block = moments.block_elements;
  const size_t blocks_per_chunk = block == 0 || kChunkElements < block ? 1 : kChunkElements / block;
  const size_t chunk_elements = block == 0 ? kChunkElements : static_cast<size_t>(block) * blocks_per_chunk;
  std::vector<ChunkEntry> chunks;
  for (size_t index = 0; index < tensor_count; ++index) {
    const size_t tensor_chunks = (tensors[index].count + chunk_elements - 1) / chunk_elements;
    if (tensor_chunks > UINT32_MAX || index > UINT32_MAX) {
      return {LaunchError::kTooLarge, "tensor " + std::to_string(index) + " of " +
                                          std::to_string(tensors[index].count) + " elements exceeds the chunk "
                                          "table's 2^32 chunks of " + std::to_string(chunk_elements)};
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
  const auto grid = static_cast<unsigned>(chunks.size());
  // cudaGetLastError below reports the last error of any earlier runtime
  // call on this thread (a success does not clear it): clear it first, so
  // that a leftover, non-sticky error of unrelated code is not blamed on
  // this launch.
  (void)cudaGetLastError();
  if (block == 0) {
    pick_kernel(grad_dtype, moments.dtype, param_copy_dtype)<<<grid, kThreads, 0, stream>>>(kt, ct, factors);
  } else {
    const size_t shared_bytes = 2 * static_cast<size_t>(block) * sizeof(float);  // at most 32 KiB (B <= 4096)
    pick_int8_kernel(grad_dtype, param_copy_dtype)<<<grid, kThreads, shared_bytes, stream>>>(
        kt, ct, factors, block, static_cast<unsigned>(chunk_elements));
  }
  err = cudaGetLastError();
  if (err != cudaSuccess) {
    cudaFreeAsync(table, stream);
    return cuda_error(err, block == 0 ? "adam_kernel launch" : "adam_int8_kernel launch");
  }
  err = cudaFreeAsync(table, stream);
  if (err != cudaSuccess) return cuda_error(err, "cudaFreeAsync (chunk table)");
  return {};
}

}  // namespace strata::offload::detail
