#pragma once
// The GPT kernels on a CUDA GPU: cuBLAS for the matrix products, our
// kernels (cuda_ops.cu) for the rest. Same semantics as CpuOps<float> (see
// strata/model/cpu_ops.h), with device pointers. Every call is enqueued on
// the stream it was given (the executor's strata::Stream, by its native
// handle): no stream, no allocation and no synchronous copy of its own; the
// executor's StreamCudaOps (cuda_executor.cpp) adds the host side (copies
// through the strata::Stream, staging from the Device, host functions).
// No vendor header here: the stream and cuBLAS handle are opaque.
//
// Errors are sticky: the first failing CUDA or cuBLAS call is kept in
// error() (ops_status() turns it into a Status); later calls are no-ops.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace strata {
enum class DType : uint8_t;  // strata/core/dtype.h (C++20) is not included by nvcc (C++17)
}

namespace strata::model::detail {

class CudaOps {
 public:
  // `cuda_stream`: a cudaStream_t (Stream::native_handle()) that outlives this.
  explicit CudaOps(void* cuda_stream);
  ~CudaOps();
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  void* stream() const { return stream_; }

  void zero(float* p, size_t n);
  // dst (device, fp32) = widen(src: device memory holding n elements of dtype)
  void widen_device(float* dst, const void* src, DType dtype, size_t n);
  // dst (device, n elements of dtype) = round_to(dtype, dst + src)
  void accumulate_device(void* dst, DType dtype, const float* src, size_t n);

  void encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int Tn, int C);
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int Tn, int C);
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                         int N, int C);
  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                          const float* mean, const float* rstd, int N, int C);
  void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* Bm,
            int ldb, float beta, float* Cm, int ldc);
  void matmul_forward(float* out, const float* inp, const float* w, const float* bias, int N, int C, int OC);
  void matmul_backward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                       int N, int C, int OC);
  void attention_forward(float* out, float* att, const float* qkv, int B, int Tn, int C, int NH);
  void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv, const float* att, int B,
                          int Tn, int C, int NH);
  void gelu_forward(float* out, const float* inp, size_t n);
  void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n);
  void residual_forward(float* out, const float* a, const float* b, size_t n);
  // Per-row losses into `losses` (the mean is taken by the caller, in a fixed order).
  void softmax_xent_forward(float* probs, float* losses, const float* logits, const int32_t* targets, int N, int V);
  void softmax_xent_backward(float* dlogits, const float* probs, const int32_t* targets, float dloss, int N, int V);

 private:
  bool check(int cuda_error, const char* what);
  bool check_blas(int blas_status, const char* what);
  void* stream_ = nullptr;       // cudaStream_t, not owned
  void* blas_ = nullptr;         // cublasHandle_t
  std::string error_;
};

}  // namespace strata::model::detail
