#pragma once
// Ops backend over host memory: forwards to the templated CPU kernels.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <tbb/parallel_for.h>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/model/cpu_ops.h"

namespace strata::model::detail {

template <typename T>
struct CpuOps {
  static constexpr bool kHostMemory = true;

  T* alloc(size_t n) {
    const size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
    return static_cast<T*>(std::aligned_alloc(64, bytes == 0 ? 64 : bytes));
  }
  void free(T* p) { std::free(p); }
  void* alloc_bytes(size_t bytes) { return std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64); }
  void free_bytes(void* p) { std::free(p); }
  int32_t* alloc_ints(size_t n) { return static_cast<int32_t*>(std::malloc(n * sizeof(int32_t) + 4)); }
  void free_ints(int32_t* p) { std::free(p); }
  void upload_ints(int32_t* dst, const int32_t* src, size_t n) { std::memcpy(dst, src, n * sizeof(int32_t)); }
  void zero(T* p, size_t n) { std::memset(p, 0, n * sizeof(T)); }

  // dst[i] = widen(src[i]) for one tensor stored in `dtype`.
  void widen(T* dst, const std::byte* src, DType dtype, size_t n) {
    tbb::parallel_for(size_t{0}, (n + 65535) / 65536, [&](size_t blk) {
      const size_t i0 = blk * 65536, i1 = std::min(n, i0 + 65536);
      for (size_t i = i0; i < i1; ++i) {
        switch (dtype) {
          case DType::kF32: {
            float v;
            std::memcpy(&v, src + 4 * i, 4);
            dst[i] = v;
            break;
          }
          case DType::kBF16: {
            uint16_t b;
            std::memcpy(&b, src + 2 * i, 2);
            dst[i] = bf16_bits_to_fp32(b);
            break;
          }
          case DType::kF16: {
            uint16_t b;
            std::memcpy(&b, src + 2 * i, 2);
            dst[i] = fp16_bits_to_fp32(b);
            break;
          }
          case DType::kF64:
          case DType::kI64: break;  // rejected by GptConfig::validate
        }
      }
    });
  }
  // host[i] += dev[i] (not needed when grads accumulate in place).
  void add_to_host(float* host, const T* dev, size_t n) {
    for (size_t i = 0; i < n; ++i) host[i] += static_cast<float>(dev[i]);
  }

  void encoder_forward(T* o, const int32_t* tok, const T* wte, const T* wpe, int B, int Tn, int C) {
    cpu::encoder_forward(o, tok, wte, wpe, B, Tn, C);
  }
  void encoder_backward(T* dwte, T* dwpe, const T* d, const int32_t* tok, int B, int Tn, int C) {
    cpu::encoder_backward(dwte, dwpe, d, tok, B, Tn, C);
  }
  void layernorm_forward(T* o, T* m, T* r, const T* x, const T* w, const T* b, int N, int C) {
    cpu::layernorm_forward(o, m, r, x, w, b, N, C);
  }
  void layernorm_backward(T* dx, T* dw, T* db, const T* d, const T* x, const T* w, const T* m, const T* r, int N,
                          int C) {
    cpu::layernorm_backward(dx, dw, db, d, x, w, m, r, N, C);
  }
  void matmul_forward(T* o, const T* x, const T* w, const T* b, int N, int C, int OC) {
    cpu::matmul_forward(o, x, w, b, N, C, OC);
  }
  void matmul_backward(T* dx, T* dw, T* db, const T* d, const T* x, const T* w, int N, int C, int OC) {
    cpu::matmul_backward(dx, dw, db, d, x, w, N, C, OC);
  }
  void attention_forward(T* o, T* att, const T* qkv, int B, int Tn, int C, int NH) {
    cpu::attention_forward(o, att, qkv, B, Tn, C, NH);
  }
  void attention_backward(T* dqkv, T* datt, const T* d, const T* qkv, const T* att, int B, int Tn, int C, int NH) {
    cpu::attention_backward(dqkv, datt, d, qkv, att, B, Tn, C, NH);
  }
  void gelu_forward(T* o, const T* x, size_t n) { cpu::gelu_forward(o, x, n); }
  void gelu_backward(T* dx, const T* x, const T* d, size_t n) { cpu::gelu_backward(dx, x, d, n); }
  void residual_forward(T* o, const T* a, const T* b, size_t n) { cpu::residual_forward(o, a, b, n); }
  T softmax_xent_forward(T* p, T* l, const T* x, const int32_t* tgt, int N, int V) {
    return cpu::softmax_xent_forward(p, l, x, tgt, N, V);
  }
  void softmax_xent_backward(T* d, const T* p, const int32_t* tgt, T dloss, int N, int V) {
    cpu::softmax_xent_backward(d, p, tgt, dloss, N, V);
  }
};

template <typename T>
Status ops_status(const CpuOps<T>&) {
  return Status::Ok();
}

}  // namespace strata::model::detail
