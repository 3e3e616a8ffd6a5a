// The cuda GptExecutor: the graph's ops as CudaOps kernels on the
// strata::Stream's cudaStream_t, plus the host side a kernel library cannot
// do: stream-ordered copies through the Stream, staging memory from the
// Device, host functions in stream order. See Note [Executor on a stream]
// in strata/model/gpt_executor.h.
#include "cuda_executor.h"

#include <fmt/format.h>

#include "../cpu_backend.h"  // accumulate_fp32_into
#include "cuda_ops.h"
#include "strata/core/status.h"
#include "strata/core/units.h"

namespace strata::model::detail {

// Note [cuda staging]
// Parameters in host memory are copied H2D into one device staging buffer
// (the largest layer) and widened from there; gradients wanted in host
// memory are copied D2H into one pinned host buffer (the largest layer, or
// the batch's per-row losses) and added by a host function. Both buffers
// are reused in stream order: a later copy into them is enqueued after the
// kernel or host function that read them, and CUDA runs a stream's work,
// host functions included, in order.
class StreamCudaOps {
 public:
  static constexpr bool kHostMemory = false;
  static constexpr bool addressable(Tier tier) { return tier == Tier::kDevice; }

  StreamCudaOps(Device& device, Stream& stream) : device_(device), stream_(stream), k_(stream.native_handle()) {}
  ~StreamCudaOps() {
    if (pinned_ != nullptr) device_.free_pinned_host(pinned_, pinned_bytes_);
  }
  StreamCudaOps(const StreamCudaOps&) = delete;
  StreamCudaOps& operator=(const StreamCudaOps&) = delete;

  Status init(size_t staging_bytes, size_t pinned_bytes) {
    if (stream_.native_handle() == nullptr)
      return InvalidArgument("cuda executor: the stream has no native cudaStream_t; create it on a cuda Device");
    if (!k_.ok()) return Internal(k_.error());
    STRATA_ASSIGN_OR_RETURN(staging_, device_.allocate(staging_bytes));
    STRATA_ASSIGN_OR_RETURN(pinned_, device_.allocate_pinned_host(pinned_bytes));
    pinned_bytes_ = pinned_bytes;
    return Status::Ok();
  }
  Status status() const {
    if (!error_.ok()) return error_;
    if (!k_.ok()) return Internal(k_.error());
    return Status::Ok();
  }

  void upload_ints(int32_t* dst, const int32_t* host_src, size_t n) {
    copy(dst, host_src, n * sizeof(int32_t), CopyKind::kHostToDevice);
  }
  void zero(float* p, size_t n) { k_.zero(p, n); }
  void widen(float* dst, const std::byte* src, DType dtype, size_t n, Tier tier) {
    if (tier == Tier::kDevice) {
      k_.widen_device(dst, src, dtype, n);
    } else if (dtype == DType::kF32) {
      copy(dst, src, n * sizeof(float), CopyKind::kHostToDevice);
    } else {
      copy(staging_.data(), src, n * dtype_size(dtype), CopyKind::kHostToDevice);
      k_.widen_device(dst, staging_.data(), dtype, n);
    }
  }
  void accumulate(void* dst, DType dtype, Tier tier, const float* src, size_t n) {
    if (tier == Tier::kDevice) {
      k_.accumulate_device(dst, dtype, src, n);
      return;
    }
    float* host = static_cast<float*>(pinned_);
    copy(host, src, n * sizeof(float), CopyKind::kDeviceToHost);
    launch([=] { accumulate_fp32_into(dst, dtype, host, n); });
  }

  void encoder_forward(float* o, const int32_t* t, const float* wte, const float* wpe, int B, int Tn, int C) {
    k_.encoder_forward(o, t, wte, wpe, B, Tn, C);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* d, const int32_t* t, int B, int Tn, int C) {
    k_.encoder_backward(dwte, dwpe, d, t, B, Tn, C);
  }
  void layernorm_forward(float* o, float* m, float* r, const float* x, const float* w, const float* b, int N, int C) {
    k_.layernorm_forward(o, m, r, x, w, b, N, C);
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* d, const float* x, const float* w,
                          const float* m, const float* r, int N, int C) {
    k_.layernorm_backward(dx, dw, db, d, x, w, m, r, N, C);
  }
  void matmul_forward(float* o, const float* x, const float* w, const float* b, int N, int C, int OC) {
    k_.matmul_forward(o, x, w, b, N, C, OC);
  }
  void matmul_backward(float* dx, float* dw, float* db, const float* d, const float* x, const float* w, int N, int C,
                       int OC) {
    k_.matmul_backward(dx, dw, db, d, x, w, N, C, OC);
  }
  void attention_forward(float* o, float* att, const float* qkv, int B, int Tn, int C, int NH) {
    k_.attention_forward(o, att, qkv, B, Tn, C, NH);
  }
  void attention_backward(float* dqkv, float* datt, const float* d, const float* qkv, const float* att, int B, int Tn,
                          int C, int NH) {
    k_.attention_backward(dqkv, datt, d, qkv, att, B, Tn, C, NH);
  }
  void gelu_forward(float* o, const float* x, size_t n) { k_.gelu_forward(o, x, n); }
  void gelu_backward(float* dx, const float* x, const float* d, size_t n) { k_.gelu_backward(dx, x, d, n); }
  void residual_forward(float* o, const float* a, const float* b, size_t n) { k_.residual_forward(o, a, b, n); }
  // Per-row losses on the device, then D2H and their mean in row order by
  // a host function (the order the cpu sums in), into *loss_out.
  void softmax_xent_forward(float* p, float* l, const float* x, const int32_t* tgt, int N, int V, float* loss_out) {
    k_.softmax_xent_forward(p, l, x, tgt, N, V);
    float* host = static_cast<float*>(pinned_);
    copy(host, l, static_cast<size_t>(N) * sizeof(float), CopyKind::kDeviceToHost);
    launch([=] {
      float total = 0;
      for (int i = 0; i < N; ++i) total += host[i];
      *loss_out = total / static_cast<float>(N);
    });
  }
  void softmax_xent_backward(float* d, const float* p, const int32_t* tgt, float dloss, int N, int V) {
    k_.softmax_xent_backward(d, p, tgt, dloss, N, V);
  }

 private:
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) {
    if (!error_.ok() || !k_.ok()) return;
    Status st = stream_.copy_async(dst, src, bytes, kind);
    if (!st.ok()) error_ = st.with_context("cuda executor copy");
  }
  template <typename F>
  void launch(F&& fn) {
    if (!error_.ok() || !k_.ok()) return;
    Status st = stream_.launch_host(std::forward<F>(fn));
    if (!st.ok()) error_ = st.with_context("cuda executor host function");
  }

  Device& device_;
  Stream& stream_;
  CudaOps k_;
  DeviceBuffer staging_;     // Note [cuda staging]
  void* pinned_ = nullptr;   // pinned host, pinned_bytes_
  size_t pinned_bytes_ = 0;
  Status error_;
};

inline Status ops_status(const StreamCudaOps& ops) { return ops.status(); }

}  // namespace strata::model::detail

#include "../executor_impl.h"

namespace strata::model::detail {

Result<std::unique_ptr<GptExecutor>> make_cuda_executor(const GptModel& model, Device& device, Stream& stream,
                                                        int batch, int seq_len) {
  size_t max_bytes = 0, max_count = 0;
  for (const LayerSpec& l : model.layers()) {
    max_bytes = std::max(max_bytes, l.param_bytes);
    max_count = std::max(max_count, l.param_count);
  }
  const size_t rows = static_cast<size_t>(batch) * static_cast<size_t>(seq_len);
  auto ops = std::make_unique<StreamCudaOps>(device, stream);
  if (Status st = ops->init(max_bytes, std::max(max_count, rows) * sizeof(float)); !st.ok())
    return st.with_context(fmt::format("cuda executor staging ({} on the device, {} pinned)", format_bytes(max_bytes, true),
                                       format_bytes(std::max(max_count, rows) * sizeof(float), true)));
  auto impl = std::make_unique<ExecutorImpl<StreamCudaOps>>(model, DeviceKind::kCuda, device, stream, batch, seq_len,
                                                            std::move(ops));
  STRATA_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<GptExecutor>(std::move(impl));
}

}  // namespace strata::model::detail
