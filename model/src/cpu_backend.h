#pragma once
// Ops backends over host memory: CpuOps<T> runs the templated CPU kernels
// at once on the calling thread (the double reference); StreamCpuOps
// enqueues each of them as work on a cpu-device Stream (the executor, see
// Note [Executor on a stream] in strata/model/gpt_executor.h).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <tbb/parallel_for.h>

#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"
#include "strata/model/cpu_ops.h"

namespace strata::model::detail {

// body(0 .. count-1) on oneTBB's workers; inline under TSan, whose runtime
// cannot see the ordering oneTBB's uninstrumented scheduler gives
// (STRATA_TSAN_SERIAL_LOOPS, set by STRATA_SANITIZE=thread).
template <typename F>
inline void parallel_blocks(size_t count, F&& body) {
#if STRATA_TSAN_SERIAL_LOOPS
  for (size_t i = 0; i < count; ++i) body(i);
#else
  tbb::parallel_for(size_t{0}, count, body);
#endif
}

// dst[i] = widen(src[i]) for one tensor stored in `dtype`.
inline void widen_to_fp32(float* dst, const std::byte* src, DType dtype, size_t n) {
  parallel_blocks((n + 65535) / 65536, [&](size_t blk) {
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

// dst[i] = round_to(dtype, dst[i] + src[i]): a working copy's gradient
// added into a provider's buffer of grad dtype `dtype` (fp32, bf16, fp16).
inline void accumulate_fp32_into(void* dst, DType dtype, const float* src, size_t n) {
  switch (dtype) {
    case DType::kF32: {
      float* d = static_cast<float*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] += src[i];
      return;
    }
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = fp32_to_bf16_bits(bf16_bits_to_fp32(d[i]) + src[i]);
      return;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = fp32_to_fp16_bits(fp16_bits_to_fp32(d[i]) + src[i]);
      return;
    }
    case DType::kF64:
    case DType::kI64: break;  // rejected by the executor's check of LayerMemory
  }
}

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
  void softmax_xent_forward(T* p, T* l, const T* x, const int32_t* tgt, int N, int V, T* loss_out) {
    *loss_out = cpu::softmax_xent_forward(p, l, x, tgt, N, V);
  }
  void softmax_xent_backward(T* d, const T* p, const int32_t* tgt, T dloss, int N, int V) {
    cpu::softmax_xent_backward(d, p, tgt, dloss, N, V);
  }
};

template <typename T>
Status ops_status(const CpuOps<T>&) {
  return Status::Ok();
}

// CpuOps<float> as stream work on a cpu-device Stream. Pointers captured by
// the enqueued functions must stay valid until the work ran (the graph's
// buffers live as long as the executor, which synchronizes on destruction).
// Errors are sticky: the first failed launch is kept (ops_status) and
// later calls enqueue nothing.
class StreamCpuOps {
 public:
  // Device memory of the cpu device is host memory: kernels read any tier.
  static constexpr bool kHostMemory = true;
  static constexpr bool addressable(Tier tier) { return tier != Tier::kNvme; }

  explicit StreamCpuOps(Stream& stream) : stream_(stream) {}
  const Status& status() const { return error_; }

  void upload_ints(int32_t* dst, const int32_t* src, size_t n) {
    enqueue([=] { std::memcpy(dst, src, n * sizeof(int32_t)); });
  }
  void zero(float* p, size_t n) {
    enqueue([=] { std::memset(p, 0, n * sizeof(float)); });
  }
  void widen(float* dst, const std::byte* src, DType dtype, size_t n, Tier) {
    enqueue([=] { widen_to_fp32(dst, src, dtype, n); });
  }
  void accumulate(void* dst, DType dtype, Tier, const float* src, size_t n) {
    enqueue([=] { accumulate_fp32_into(dst, dtype, src, n); });
  }

  void encoder_forward(float* o, const int32_t* tok, const float* wte, const float* wpe, int B, int Tn, int C) {
    enqueue([=] { cpu::encoder_forward(o, tok, wte, wpe, B, Tn, C); });
  }
  void encoder_backward(float* dwte, float* dwpe, const float* d, const int32_t* tok, int B, int Tn, int C) {
    enqueue([=] { cpu::encoder_backward(dwte, dwpe, d, tok, B, Tn, C); });
  }
  void layernorm_forward(float* o, float* m, float* r, const float* x, const float* w, const float* b, int N, int C) {
    enqueue([=] { cpu::layernorm_forward(o, m, r, x, w, b, N, C); });
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* d, const float* x, const float* w,
                          const float* m, const float* r, int N, int C) {
    enqueue([=] { cpu::layernorm_backward(dx, dw, db, d, x, w, m, r, N, C); });
  }
  void matmul_forward(float* o, const float* x, const float* w, const float* b, int N, int C, int OC) {
    enqueue([=] { cpu::matmul_forward(o, x, w, b, N, C, OC); });
  }
  void matmul_backward(float* dx, float* dw, float* db, const float* d, const float* x, const float* w, int N, int C,
                       int OC) {
    enqueue([=] { cpu::matmul_backward(dx, dw, db, d, x, w, N, C, OC); });
  }
  void attention_forward(float* o, float* att, const float* qkv, int B, int Tn, int C, int NH) {
    enqueue([=] { cpu::attention_forward(o, att, qkv, B, Tn, C, NH); });
  }
  void attention_backward(float* dqkv, float* datt, const float* d, const float* qkv, const float* att, int B, int Tn,
                          int C, int NH) {
    enqueue([=] { cpu::attention_backward(dqkv, datt, d, qkv, att, B, Tn, C, NH); });
  }
  void gelu_forward(float* o, const float* x, size_t n) {
    enqueue([=] { cpu::gelu_forward(o, x, n); });
  }
  void gelu_backward(float* dx, const float* x, const float* d, size_t n) {
    enqueue([=] { cpu::gelu_backward(dx, x, d, n); });
  }
  void residual_forward(float* o, const float* a, const float* b, size_t n) {
    enqueue([=] { cpu::residual_forward(o, a, b, n); });
  }
  void softmax_xent_forward(float* p, float* l, const float* x, const int32_t* tgt, int N, int V, float* loss_out) {
    enqueue([=] { *loss_out = cpu::softmax_xent_forward(p, l, x, tgt, N, V); });
  }
  void softmax_xent_backward(float* d, const float* p, const int32_t* tgt, float dloss, int N, int V) {
    enqueue([=] { cpu::softmax_xent_backward(d, p, tgt, dloss, N, V); });
  }

 private:
  template <typename F>
  void enqueue(F&& fn) {
    if (!error_.ok()) return;
    Status st = stream_.launch_host(std::forward<F>(fn));
    if (!st.ok()) error_ = st.with_context("enqueueing a model kernel on the cpu device stream");
  }
  Stream& stream_;
  Status error_;
};

inline Status ops_status(const StreamCpuOps& ops) { return ops.status(); }

}  // namespace strata::model::detail
