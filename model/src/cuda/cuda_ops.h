#pragma once
// Ops backend on a CUDA GPU: cuBLAS for the matrix products, our kernels
// (cuda_ops.cu) for the rest. Same signatures and semantics as CpuOps<float>
// (see strata/model/cpu_ops.h), with device pointers. No vendor header
// here: the stream and cuBLAS handle are opaque.
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
  static constexpr bool kHostMemory = false;
  CudaOps();
  ~CudaOps();
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

  float* alloc(size_t n);
  void* alloc_bytes(size_t bytes);
  void free_bytes(void* p);
  void free(float* p);
  int32_t* alloc_ints(size_t n);
  void free_ints(int32_t* p);
  void upload_ints(int32_t* dst, const int32_t* host_src, size_t n);
  void zero(float* p, size_t n);
  void upload(float* dst, const float* host_src, size_t n);
  void download(float* host_dst, const float* src, size_t n);
  // dst (device, fp32) = widen(host_src stored as dtype)
  void widen(float* dst, const std::byte* host_src, DType dtype, size_t n);
  // host[i] += dev[i]
  void add_to_host(float* host, const float* dev, size_t n);
  void synchronize();

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
  float softmax_xent_forward(float* probs, float* losses, const float* logits, const int32_t* targets, int N, int V);
  void softmax_xent_backward(float* dlogits, const float* probs, const int32_t* targets, float dloss, int N, int V);

 private:
  bool check(int cuda_error, const char* what);
  bool check_blas(int blas_status, const char* what);
  void* stream_ = nullptr;       // cudaStream_t
  void* blas_ = nullptr;         // cublasHandle_t
  void* staging_ = nullptr;      // device bytes for widen()
  size_t staging_bytes_ = 0;
  std::vector<float> host_scratch_;
  std::string error_;
};

}  // namespace strata::model::detail
