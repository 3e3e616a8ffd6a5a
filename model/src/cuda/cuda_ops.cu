// CUDA kernels of the GPT ops; each mirrors its CPU reference in
// model/src/cpu_ops.cpp and is compared with it in tests/model/cuda_ops_test.cpp.
// Kernels favour plain, deterministic code over speed: every reduction
// runs in a fixed order inside one thread or one block, and no atomics are
// used, so the same inputs give the same bits run after run.
#include "cuda_ops.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>

namespace strata::model::detail {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;

inline unsigned blocks_for(size_t n, unsigned threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

__global__ void encoder_forward_kernel(float* out, const int32_t* tokens, const float* wte, const float* wpe, int BT,
                                       int Tn, int C) {
  const size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<size_t>(BT) * C) return;
  const int i = static_cast<int>(idx / C), c = static_cast<int>(idx % C);
  out[idx] = wte[static_cast<size_t>(tokens[i]) * C + c] + wpe[static_cast<size_t>(i % Tn) * C + c];
}

// One thread per channel walks every row in order: no write conflicts.
__global__ void encoder_backward_kernel(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int BT,
                                        int Tn, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int i = 0; i < BT; ++i) {
    const float d = dout[static_cast<size_t>(i) * C + c];
    dwte[static_cast<size_t>(tokens[i]) * C + c] += d;
    dwpe[static_cast<size_t>(i % Tn) * C + c] += d;
  }
}

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One warp per row.
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp, const float* w,
                                         const float* b, int N, int C) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* x = inp + static_cast<size_t>(row) * C;
  float s = 0;
  for (int c = lane; c < C; c += 32) s += x[c];
  const float m = warp_sum(s) / C;
  float v = 0;
  for (int c = lane; c < C; c += 32) v += (x[c] - m) * (x[c] - m);
  const float r = rsqrtf(warp_sum(v) / C + 1e-5f);
  float* o = out + static_cast<size_t>(row) * C;
  for (int c = lane; c < C; c += 32) o[c] = (x[c] - m) * r * w[c] + b[c];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

__global__ void layernorm_backward_input_kernel(float* dinp, const float* dout, const float* inp, const float* w,
                                                const float* mean, const float* rstd, int N, int C) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* d = dout + static_cast<size_t>(row) * C;
  const float* x = inp + static_cast<size_t>(row) * C;
  const float m = mean[row], r = rstd[row];
  float a = 0, bsum = 0;
  for (int c = lane; c < C; c += 32) {
    const float dn = w[c] * d[c];
    a += dn;
    bsum += dn * (x[c] - m) * r;
  }
  a = warp_sum(a) / C;
  bsum = warp_sum(bsum) / C;
  float* dx = dinp + static_cast<size_t>(row) * C;
  for (int c = lane; c < C; c += 32) {
    const float norm = (x[c] - m) * r;
    dx[c] += (w[c] * d[c] - a - norm * bsum) * r;
  }
}

__global__ void layernorm_backward_params_kernel(float* dw, float* db, const float* dout, const float* inp,
                                                 const float* mean, const float* rstd, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float gw = 0, gb = 0;
  for (int i = 0; i < N; ++i) {
    const float d = dout[static_cast<size_t>(i) * C + c];
    gw += (inp[static_cast<size_t>(i) * C + c] - mean[i]) * rstd[i] * d;
    gb += d;
  }
  dw[c] += gw;
  db[c] += gb;
}

__global__ void broadcast_rows_kernel(float* out, const float* bias, int N, int OC) {
  const size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (idx < static_cast<size_t>(N) * OC) out[idx] = bias[idx % OC];
}

__global__ void column_sum_kernel(float* dbias, const float* dout, int N, int OC) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= OC) return;
  float s = 0;
  for (int i = 0; i < N; ++i) s += dout[static_cast<size_t>(i) * OC + o];
  dbias[o] += s;
}

// One thread per (b, h, t) query row.
__global__ void attention_forward_kernel(float* out, float* att, const float* qkv, int B, int Tn, int C, int NH) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= B * NH * Tn) return;
  const int t = idx % Tn, h = (idx / Tn) % NH, b = idx / (Tn * NH);
  const int hs = C / NH;
  const float scale = rsqrtf(static_cast<float>(hs));
  const size_t C3 = 3 * static_cast<size_t>(C);
  const float* q = qkv + (static_cast<size_t>(b) * Tn + t) * C3 + h * hs;
  float* a = att + ((static_cast<size_t>(b) * NH + h) * Tn + t) * Tn;
  float maxv = -INFINITY;
  for (int t2 = 0; t2 <= t; ++t2) {
    const float* k = qkv + (static_cast<size_t>(b) * Tn + t2) * C3 + C + h * hs;
    float dot = 0;
    for (int i = 0; i < hs; ++i) dot += q[i] * k[i];
    dot *= scale;
    a[t2] = dot;
    maxv = fmaxf(maxv, dot);
  }
  float sum = 0;
  for (int t2 = 0; t2 <= t; ++t2) {
    a[t2] = expf(a[t2] - maxv);
    sum += a[t2];
  }
  const float inv = 1.0f / sum;
  for (int t2 = 0; t2 <= t; ++t2) a[t2] *= inv;
  for (int t2 = t + 1; t2 < Tn; ++t2) a[t2] = 0;
  float* o = out + (static_cast<size_t>(b) * Tn + t) * C + h * hs;
  for (int i = 0; i < hs; ++i) {
    float acc = 0;
    for (int t2 = 0; t2 <= t; ++t2) acc += a[t2] * qkv[(static_cast<size_t>(b) * Tn + t2) * C3 + 2 * C + h * hs + i];
    o[i] = acc;
  }
}

// datt[b,h,t,t2] = dout[b,t,h,:] . v[b,t2,h,:]   (t2 <= t), one thread each.
__global__ void attention_datt_kernel(float* datt, const float* dout, const float* qkv, int B, int Tn, int C, int NH) {
  const size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<size_t>(B) * NH * Tn * Tn) return;
  const int t2 = static_cast<int>(idx % Tn), t = static_cast<int>((idx / Tn) % Tn);
  const int h = static_cast<int>((idx / (static_cast<size_t>(Tn) * Tn)) % NH);
  const int b = static_cast<int>(idx / (static_cast<size_t>(Tn) * Tn * NH));
  if (t2 > t) {
    datt[idx] = 0;
    return;
  }
  const int hs = C / NH;
  const size_t C3 = 3 * static_cast<size_t>(C);
  const float* d = dout + (static_cast<size_t>(b) * Tn + t) * C + h * hs;
  const float* v = qkv + (static_cast<size_t>(b) * Tn + t2) * C3 + 2 * C + h * hs;
  float dot = 0;
  for (int i = 0; i < hs; ++i) dot += d[i] * v[i];
  datt[idx] = dot;
}

// In place: datt row -> dpreatt row (softmax backward, times the scale).
__global__ void attention_softmax_backward_kernel(float* datt, const float* att, int rows, int Tn, float scale) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const int t = row % Tn;
  const float* a = att + static_cast<size_t>(row) * Tn;
  float* d = datt + static_cast<size_t>(row) * Tn;
  float s = 0;
  for (int t2 = 0; t2 <= t; ++t2) s += a[t2] * d[t2];
  for (int t2 = 0; t2 <= t; ++t2) d[t2] = a[t2] * (d[t2] - s) * scale;
}

// dq, dk, dv for one (b, t, h, i) each; sums over the other position in order.
__global__ void attention_dqkv_kernel(float* dqkv, const float* dpre, const float* att, const float* dout,
                                      const float* qkv, int B, int Tn, int C, int NH) {
  const size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<size_t>(B) * Tn * C) return;
  const int hs = C / NH;
  const int c = static_cast<int>(idx % C), t = static_cast<int>((idx / C) % Tn), b = static_cast<int>(idx / (static_cast<size_t>(C) * Tn));
  const int h = c / hs, i = c % hs;
  const size_t C3 = 3 * static_cast<size_t>(C);
  const size_t att_base = (static_cast<size_t>(b) * NH + h) * Tn * Tn;
  const float* base = qkv + static_cast<size_t>(b) * Tn * C3;
  float dq = 0;
  for (int t2 = 0; t2 <= t; ++t2) dq += dpre[att_base + static_cast<size_t>(t) * Tn + t2] * base[t2 * C3 + C + h * hs + i];
  float dk = 0, dv = 0;
  for (int tq = t; tq < Tn; ++tq) {
    dk += dpre[att_base + static_cast<size_t>(tq) * Tn + t] * base[tq * C3 + h * hs + i];
    dv += att[att_base + static_cast<size_t>(tq) * Tn + t] * dout[(static_cast<size_t>(b) * Tn + tq) * C + h * hs + i];
  }
  float* drow = dqkv + (static_cast<size_t>(b) * Tn + t) * C3;
  drow[h * hs + i] += dq;
  drow[C + h * hs + i] += dk;
  drow[2 * C + h * hs + i] += dv;
}

__global__ void gelu_forward_kernel(float* out, const float* inp, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  out[i] = 0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x)));
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  const float th = tanhf(kGeluScale * (x + 0.044715f * x * x * x));
  const float local = 0.5f * (1.0f + th) + x * 0.5f * (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
  dinp[i] += local * dout[i];
}

__global__ void add_kernel(float* out, const float* a, const float* b, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

// One block per row; fixed-shape tree reductions in shared memory.
constexpr int kSoftmaxThreads = 256;
__global__ void softmax_xent_forward_kernel(float* probs, float* losses, const float* logits, const int32_t* targets,
                                            int V) {
  __shared__ float red[kSoftmaxThreads];
  const int row = blockIdx.x;
  const float* x = logits + static_cast<size_t>(row) * V;
  float* p = probs + static_cast<size_t>(row) * V;
  float m = -INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, x[v]);
  red[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const float maxv = red[0];
  __syncthreads();
  float sum = 0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float e = expf(x[v] - maxv);
    p[v] = e;
    sum += e;
  }
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  const float total = red[0];
  const float inv = 1.0f / total;
  for (int v = threadIdx.x; v < V; v += blockDim.x) p[v] *= inv;
  if (threadIdx.x == 0) losses[row] = -(x[targets[row]] - maxv - logf(total));
}

__global__ void softmax_xent_backward_kernel(float* dlogits, const float* probs, const int32_t* targets, float dloss,
                                             int N, int V) {
  const size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<size_t>(N) * V) return;
  const int row = static_cast<int>(idx / V), v = static_cast<int>(idx % V);
  dlogits[idx] = probs[idx] * dloss - (v == targets[row] ? dloss : 0.0f);
}

// dst = round(dst + src) in bf16 (is_bf16) or fp16, round to nearest even.
__global__ void accumulate_16_kernel(uint16_t* dst, const float* src, int is_bf16, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (is_bf16) {
    const float sum = __uint_as_float(static_cast<unsigned>(dst[i]) << 16) + src[i];
    dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(sum));
  } else {
    const float sum = __half2float(__ushort_as_half(dst[i])) + src[i];
    dst[i] = __half_as_ushort(__float2half_rn(sum));
  }
}

__global__ void accumulate_f32_kernel(float* dst, const float* src, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] += src[i];
}

__global__ void widen_kernel(float* dst, const uint16_t* src, int is_bf16, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (is_bf16) {
    dst[i] = __uint_as_float(static_cast<unsigned>(src[i]) << 16);
  } else {
    dst[i] = __half2float(__ushort_as_half(src[i]));
  }
}

}  // namespace

#define STRATA_CUDA_STREAM static_cast<cudaStream_t>(stream_)
#define STRATA_LAUNCH_CHECK(what) check(static_cast<int>(cudaGetLastError()), what)

bool CudaOps::check(int err, const char* what) {
  if (err == cudaSuccess) return true;
  if (ok()) error_ = std::string("CUDA error in ") + what + ": " + cudaGetErrorString(static_cast<cudaError_t>(err));
  return false;
}

bool CudaOps::check_blas(int st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return true;
  if (ok()) error_ = std::string("cuBLAS error ") + std::to_string(st) + " in " + what;
  return false;
}

CudaOps::CudaOps(void* cuda_stream) : stream_(cuda_stream) {
  cublasHandle_t h = nullptr;
  if (!check_blas(cublasCreate(&h), "cublasCreate")) return;
  blas_ = h;
  check_blas(cublasSetStream(h, STRATA_CUDA_STREAM), "cublasSetStream");
  // Full fp32 products (no TF32), so results compare with the CPU closely.
  check_blas(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  // Every kernel is loaded now, before any stream is gated: CUDA's lazy
  // loading at a first launch may wait for the whole device to go idle,
  // which a stream parked on a host completion never lets happen
  // (docs/core.md, "No first kernel launch while a stream is gated").
  const void* kernels[] = {
      reinterpret_cast<const void*>(&encoder_forward_kernel),
      reinterpret_cast<const void*>(&encoder_backward_kernel),
      reinterpret_cast<const void*>(&layernorm_forward_kernel),
      reinterpret_cast<const void*>(&layernorm_backward_input_kernel),
      reinterpret_cast<const void*>(&layernorm_backward_params_kernel),
      reinterpret_cast<const void*>(&broadcast_rows_kernel),
      reinterpret_cast<const void*>(&column_sum_kernel),
      reinterpret_cast<const void*>(&attention_forward_kernel),
      reinterpret_cast<const void*>(&attention_datt_kernel),
      reinterpret_cast<const void*>(&attention_softmax_backward_kernel),
      reinterpret_cast<const void*>(&attention_dqkv_kernel),
      reinterpret_cast<const void*>(&gelu_forward_kernel),
      reinterpret_cast<const void*>(&gelu_backward_kernel),
      reinterpret_cast<const void*>(&add_kernel),
      reinterpret_cast<const void*>(&softmax_xent_forward_kernel),
      reinterpret_cast<const void*>(&softmax_xent_backward_kernel),
      reinterpret_cast<const void*>(&accumulate_16_kernel),
      reinterpret_cast<const void*>(&accumulate_f32_kernel),
      reinterpret_cast<const void*>(&widen_kernel),
  };
  // On the stream's GPU (the kernels load into its context), then back.
  int stream_device = 0, previous_device = 0;
  if (!check(static_cast<int>(cudaStreamGetDevice(STRATA_CUDA_STREAM, &stream_device)), "cudaStreamGetDevice")) return;
  if (!check(static_cast<int>(cudaGetDevice(&previous_device)), "cudaGetDevice")) return;
  if (stream_device != previous_device &&
      !check(static_cast<int>(cudaSetDevice(stream_device)), "cudaSetDevice (loading the model kernels)"))
    return;
  struct RestoreDevice {
    int device;
    bool switched;
    ~RestoreDevice() {
      if (switched) cudaSetDevice(device);
    }
  } restore{previous_device, stream_device != previous_device};
  cudaFuncAttributes attributes{};
  for (const void* kernel : kernels) {
    if (!check(static_cast<int>(cudaFuncGetAttributes(&attributes, kernel)), "cudaFuncGetAttributes (the model kernels)"))
      return;
  }
}

CudaOps::~CudaOps() {
  // The stream is the executor's; its owner synchronizes it before this runs.
  if (blas_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(blas_));
}

void CudaOps::zero(float* p, size_t n) {
  if (ok()) check(cudaMemsetAsync(p, 0, n * sizeof(float), STRATA_CUDA_STREAM), "zero");
}

void CudaOps::widen_device(float* dst, const void* src, DType dtype, size_t n) {
  if (!ok()) return;
  // DType values (strata/core/dtype.h): kF32 = 0, kF16 = 1, kBF16 = 2.
  const auto code = static_cast<uint8_t>(dtype);
  if (code == 0) {
    check(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, STRATA_CUDA_STREAM), "widen copy");
    return;
  }
  widen_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(dst, static_cast<const uint16_t*>(src),
                                                                   code == 2 ? 1 : 0, n);
  STRATA_LAUNCH_CHECK("widen_kernel");
}

void CudaOps::accumulate_device(void* dst, DType dtype, const float* src, size_t n) {
  if (!ok()) return;
  const auto code = static_cast<uint8_t>(dtype);
  if (code == 0) {
    accumulate_f32_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(static_cast<float*>(dst), src, n);
  } else {
    accumulate_16_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(static_cast<uint16_t*>(dst), src,
                                                                             code == 2 ? 1 : 0, n);
  }
  STRATA_LAUNCH_CHECK("accumulate_kernel");
}

void CudaOps::encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int Tn,
                              int C) {
  const size_t n = static_cast<size_t>(B) * Tn * C;
  encoder_forward_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(out, tokens, wte, wpe, B * Tn, Tn, C);
  STRATA_LAUNCH_CHECK("encoder_forward");
}
void CudaOps::encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int Tn,
                               int C) {
  encoder_backward_kernel<<<blocks_for(C, 128), 128, 0, STRATA_CUDA_STREAM>>>(dwte, dwpe, dout, tokens, B * Tn, Tn, C);
  STRATA_LAUNCH_CHECK("encoder_backward");
}
void CudaOps::layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                                const float* b, int N, int C) {
  layernorm_forward_kernel<<<blocks_for(N, 8), 256, 0, STRATA_CUDA_STREAM>>>(out, mean, rstd, inp, w, b, N, C);
  STRATA_LAUNCH_CHECK("layernorm_forward");
}
void CudaOps::layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                                 const float* w, const float* mean, const float* rstd, int N, int C) {
  layernorm_backward_input_kernel<<<blocks_for(N, 8), 256, 0, STRATA_CUDA_STREAM>>>(dinp, dout, inp, w, mean, rstd, N, C);
  STRATA_LAUNCH_CHECK("layernorm_backward_input");
  layernorm_backward_params_kernel<<<blocks_for(C, 128), 128, 0, STRATA_CUDA_STREAM>>>(dw, db, dout, inp, mean, rstd, N, C);
  STRATA_LAUNCH_CHECK("layernorm_backward_params");
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
void CudaOps::gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                   const float* Bm, int ldb, float beta, float* Cm, int ldc) {
  if (!ok()) return;
  check_blas(cublasSgemm(static_cast<cublasHandle_t>(blas_), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                         trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, Bm, ldb, A, lda, &beta, Cm, ldc),
             "cublasSgemm");
}
void CudaOps::matmul_forward(float* out, const float* inp, const float* w, const float* bias, int N, int C, int OC) {
  if (bias != nullptr) {
    const size_t n = static_cast<size_t>(N) * OC;
    broadcast_rows_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(out, bias, N, OC);
    STRATA_LAUNCH_CHECK("broadcast_rows");
  }
  gemm(false, true, N, OC, C, 1.0f, inp, C, w, C, bias != nullptr ? 1.0f : 0.0f, out, OC);
}
void CudaOps::matmul_backward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                              const float* w, int N, int C, int OC) {
  gemm(false, false, N, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C);
  gemm(true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dw, C);
  if (dbias != nullptr) {
    column_sum_kernel<<<blocks_for(OC, 128), 128, 0, STRATA_CUDA_STREAM>>>(dbias, dout, N, OC);
    STRATA_LAUNCH_CHECK("column_sum");
  }
}
void CudaOps::attention_forward(float* out, float* att, const float* qkv, int B, int Tn, int C, int NH) {
  attention_forward_kernel<<<blocks_for(static_cast<size_t>(B) * NH * Tn, 64), 64, 0, STRATA_CUDA_STREAM>>>(
      out, att, qkv, B, Tn, C, NH);
  STRATA_LAUNCH_CHECK("attention_forward");
}
void CudaOps::attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv, const float* att,
                                 int B, int Tn, int C, int NH) {
  const size_t cells = static_cast<size_t>(B) * NH * Tn * Tn;
  attention_datt_kernel<<<blocks_for(cells, 256), 256, 0, STRATA_CUDA_STREAM>>>(datt, dout, qkv, B, Tn, C, NH);
  STRATA_LAUNCH_CHECK("attention_datt");
  const float scale = 1.0f / std::sqrt(static_cast<float>(C / NH));
  attention_softmax_backward_kernel<<<blocks_for(static_cast<size_t>(B) * NH * Tn, 128), 128, 0, STRATA_CUDA_STREAM>>>(
      datt, att, B * NH * Tn, Tn, scale);
  STRATA_LAUNCH_CHECK("attention_softmax_backward");
  const size_t n = static_cast<size_t>(B) * Tn * C;
  attention_dqkv_kernel<<<blocks_for(n, 128), 128, 0, STRATA_CUDA_STREAM>>>(dqkv, datt, att, dout, qkv, B, Tn, C, NH);
  STRATA_LAUNCH_CHECK("attention_dqkv");
}
void CudaOps::gelu_forward(float* out, const float* inp, size_t n) {
  gelu_forward_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(out, inp, n);
  STRATA_LAUNCH_CHECK("gelu_forward");
}
void CudaOps::gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) {
  gelu_backward_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(dinp, inp, dout, n);
  STRATA_LAUNCH_CHECK("gelu_backward");
}
void CudaOps::residual_forward(float* out, const float* a, const float* b, size_t n) {
  add_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(out, a, b, n);
  STRATA_LAUNCH_CHECK("residual_forward");
}
void CudaOps::softmax_xent_forward(float* probs, float* losses, const float* logits, const int32_t* targets, int N,
                                   int V) {
  softmax_xent_forward_kernel<<<N, kSoftmaxThreads, 0, STRATA_CUDA_STREAM>>>(probs, losses, logits, targets, V);
  STRATA_LAUNCH_CHECK("softmax_xent_forward");
}
void CudaOps::softmax_xent_backward(float* dlogits, const float* probs, const int32_t* targets, float dloss, int N,
                                    int V) {
  const size_t n = static_cast<size_t>(N) * V;
  softmax_xent_backward_kernel<<<blocks_for(n, 256), 256, 0, STRATA_CUDA_STREAM>>>(dlogits, probs, targets, dloss, N, V);
  STRATA_LAUNCH_CHECK("softmax_xent_backward");
}

}  // namespace strata::model::detail
