#pragma once
// The GPT forward and backward pass, written once against an Ops backend
// (CpuOps<float>, CpuOps<double>, CudaOps) and a LayerSource that hands out
// working copies of one layer's parameters and gradients at a time.
//
// Note [Layer order of one step]
// forward:  E(0) enc; for l: E(l+1) block; A(L+1) lnf; E(0) head+loss; R(L+1)
//           where E(i) = acquire(i, fwd) ... release(i, fwd)
// backward: E(0) head; E(L+1) lnf; for l = L-1..0: E(l+1) block; E(0) encoder
// Layer 0 (the embedding, tied to the LM head) is acquired twice in
// backward and not held in between, so a provider may drop it while the
// blocks run. Its gradient still sums the head's contribution first and the
// encoder's second, in the same buffer, exactly as when it was held
// throughout (see Note [Acquire and release] in strata/core/layered_model.h).
//
// With a streamed Ops backend every ops_ call only enqueues work, so the
// graph's code is the same for synchronous (CpuOps<double>) and streamed
// (StreamCpuOps, CudaOps) backends; the loss arrives through `loss_out`,
// written by stream work.

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "strata/core/status.h"
#include "strata/core/units.h"
#include "strata/model/gpt.h"

namespace strata::model::detail {

// Bytes in use / at peak of one memory tier, with an optional capacity.
struct TierCounter {
  uint64_t current = 0;
  uint64_t peak = 0;
  uint64_t capacity = 0;  // 0 = unlimited
  Status reserve(uint64_t bytes, std::string_view what) {
    if (capacity != 0 && current + bytes > capacity)
      return OutOfMemory(fmt::format(
          "device memory: {} needs {} but only {} of the {} capacity (--device-memory) is free; "
          "lower --batch or --seq, or raise --device-memory",
          what, format_bytes(bytes, true), format_bytes(capacity - current, true), format_bytes(capacity, true)));
    current += bytes;
    if (current > peak) peak = current;
    return Status::Ok();
  }
  void unreserve(uint64_t bytes) { current -= bytes; }
};

// Where a graph's device memory comes from: the core Device (cpu) or a
// backend's own allocator under a TierCounter (cuda, double reference).
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual Result<void*> allocate(size_t bytes, std::string_view what) = 0;
  virtual void free(void* ptr, size_t bytes) = 0;
  virtual uint64_t current_bytes() const = 0;
  virtual uint64_t peak_bytes() const = 0;
  virtual uint64_t capacity_bytes() const = 0;  // 0 = unlimited
};

template <typename Ops>
class CountingAllocator final : public DeviceAllocator {
 public:
  CountingAllocator(Ops& ops, uint64_t capacity) : ops_(ops) { counter_.capacity = capacity; }
  Result<void*> allocate(size_t bytes, std::string_view what) override {
    STRATA_RETURN_IF_ERROR(counter_.reserve(bytes, what));
    void* p = ops_.alloc_bytes(bytes);
    if (p == nullptr) {
      counter_.unreserve(bytes);
      return OutOfMemory(fmt::format("device allocation of {} for {} failed", format_bytes(bytes, true), what));
    }
    return p;
  }
  void free(void* ptr, size_t bytes) override {
    ops_.free_bytes(ptr);
    counter_.unreserve(bytes);
  }
  uint64_t current_bytes() const override { return counter_.current; }
  uint64_t peak_bytes() const override { return counter_.peak; }
  uint64_t capacity_bytes() const override { return counter_.capacity; }

 private:
  Ops& ops_;
  TierCounter counter_;
};

template <typename T>
class LayerSource {
 public:
  virtual ~LayerSource() = default;
  virtual Result<const T*> acquire_forward(size_t layer) = 0;
  virtual Status release_forward(size_t layer) = 0;
  virtual Result<std::pair<const T*, T*>> acquire_backward(size_t layer) = 0;
  virtual Status release_backward(size_t layer) = 0;
};

template <typename T, typename Ops>
class GptGraph {
 public:
  GptGraph(const GptModel& model, Ops& ops, DeviceAllocator& device, int B, int Tn)
      : model_(model), cfg_(model.config()), ops_(ops), device_(device), B_(B), T_(Tn) {}
  GptGraph(const GptGraph&) = delete;
  GptGraph& operator=(const GptGraph&) = delete;
  ~GptGraph() {
    for (auto& [ptr, bytes] : owned_) device_.free(ptr, bytes);
  }

  Status allocate() {
    const size_t N = static_cast<size_t>(B_) * T_, C = cfg_.n_embd, V = cfg_.vocab_size;
    const size_t L = cfg_.n_layer, NH = cfg_.n_head;
    const size_t att = static_cast<size_t>(B_) * NH * T_ * T_;
    STRATA_RETURN_IF_ERROR(get(encoded_, N * C, "activations"));
    acts_.resize(L);
    for (auto& a : acts_) {
      STRATA_RETURN_IF_ERROR(get(a.ln1, N * C, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.ln1_mean, N, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.ln1_rstd, N, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.qkv, N * 3 * C, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.atty, N * C, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.att, att, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.residual2, N * C, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.ln2, N * C, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.ln2_mean, N, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.ln2_rstd, N, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.fch, N * 4 * C, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.fch_gelu, N * 4 * C, "activations"));
      STRATA_RETURN_IF_ERROR(get(a.residual3, N * C, "activations"));
    }
    STRATA_RETURN_IF_ERROR(get(proj_, N * C, "activations"));
    STRATA_RETURN_IF_ERROR(get(lnf_, N * C, "activations"));
    STRATA_RETURN_IF_ERROR(get(lnf_mean_, N, "activations"));
    STRATA_RETURN_IF_ERROR(get(lnf_rstd_, N, "activations"));
    STRATA_RETURN_IF_ERROR(get(logits_, N * V, "logits"));
    STRATA_RETURN_IF_ERROR(get(probs_, N * V, "logits"));
    STRATA_RETURN_IF_ERROR(get(losses_, N, "activations"));
    // Gradient scratch, reused by every layer.
    STRATA_RETURN_IF_ERROR(get(dres_, N * C, "activation gradients"));
    STRATA_RETURN_IF_ERROR(get(dln_, N * C, "activation gradients"));
    STRATA_RETURN_IF_ERROR(get(datty_, N * C, "activation gradients"));
    STRATA_RETURN_IF_ERROR(get(dqkv_, N * 3 * C, "activation gradients"));
    STRATA_RETURN_IF_ERROR(get(datt_, att, "activation gradients"));
    STRATA_RETURN_IF_ERROR(get(dfch_, N * 4 * C, "activation gradients"));
    STRATA_RETURN_IF_ERROR(get(dfch_gelu_, N * 4 * C, "activation gradients"));
    STRATA_RETURN_IF_ERROR(get_bytes(tokens_, N * sizeof(int32_t), "token ids"));
    STRATA_RETURN_IF_ERROR(get_bytes(targets_, N * sizeof(int32_t), "token ids"));
    return Status::Ok();
  }

  // Forward pass. `keep_for_backward` false: an evaluation pass, no backward
  // may follow. The mean loss is written to *loss_out (by stream work on a
  // streamed backend). `tokens`/`targets` are host ids that must stay valid
  // until the upload ran.
  Status forward(const int32_t* tokens, const int32_t* targets, LayerSource<T>& src, T* loss_out,
                 bool keep_for_backward) {
    have_forward_ = false;
    const int N = B_ * T_, C = cfg_.n_embd, V = cfg_.vocab_size, NH = cfg_.n_head;
    const size_t NC = static_cast<size_t>(N) * C;
    ops_.upload_ints(tokens_, tokens, N);
    ops_.upload_ints(targets_, targets, N);
    {
      STRATA_ASSIGN_OR_RETURN(const T* p, src.acquire_forward(0));
      ops_.encoder_forward(encoded_, tokens_, p + off(0, kWte), p + off(0, kWpe), B_, T_, C);
      STRATA_RETURN_IF_ERROR(src.release_forward(0));
    }
    const T* residual = encoded_;
    for (int l = 0; l < cfg_.n_layer; ++l) {
      const size_t li = model_.block_layer(l);
      STRATA_ASSIGN_OR_RETURN(const T* p, src.acquire_forward(li));
      Acts& a = acts_[l];
      auto w = [&](int tensor) { return p + off(li, tensor); };
      ops_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, residual, w(kLn1W), w(kLn1B), N, C);
      ops_.matmul_forward(a.qkv, a.ln1, w(kQkvW), w(kQkvB), N, C, 3 * C);
      ops_.attention_forward(a.atty, a.att, a.qkv, B_, T_, C, NH);
      ops_.matmul_forward(proj_, a.atty, w(kAttnProjW), w(kAttnProjB), N, C, C);
      ops_.residual_forward(a.residual2, residual, proj_, NC);
      ops_.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, w(kLn2W), w(kLn2B), N, C);
      ops_.matmul_forward(a.fch, a.ln2, w(kFcW), w(kFcB), N, C, 4 * C);
      ops_.gelu_forward(a.fch_gelu, a.fch, NC * 4);
      ops_.matmul_forward(proj_, a.fch_gelu, w(kFcProjW), w(kFcProjB), N, 4 * C, C);
      ops_.residual_forward(a.residual3, a.residual2, proj_, NC);
      STRATA_RETURN_IF_ERROR(src.release_forward(li));
      residual = a.residual3;
    }
    const size_t lf = model_.final_layer();
    STRATA_ASSIGN_OR_RETURN(const T* pf, src.acquire_forward(lf));
    ops_.layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, residual, pf + off(lf, kLnfW), pf + off(lf, kLnfB), N, C);
    STRATA_ASSIGN_OR_RETURN(const T* p0, src.acquire_forward(0));
    ops_.matmul_forward(logits_, lnf_, p0 + off(0, kWte), static_cast<const T*>(nullptr), N, C, V);
    ops_.softmax_xent_forward(probs_, losses_, logits_, targets_, N, V, loss_out);
    STRATA_RETURN_IF_ERROR(src.release_forward(0));
    STRATA_RETURN_IF_ERROR(src.release_forward(lf));
    have_forward_ = keep_for_backward;
    return Status::Ok();
  }

  // Backward of the last forward; dloss scales the gradient of the mean loss
  // (1 for one micro-batch, 1/k for gradient accumulation over k).
  Status backward(T dloss, LayerSource<T>& src) {
    if (!have_forward_) return FailedPrecondition("backward() called without a forward() before it");
    have_forward_ = false;
    const int N = B_ * T_, C = cfg_.n_embd, V = cfg_.vocab_size, NH = cfg_.n_head;
    const size_t NC = static_cast<size_t>(N) * C;
    const size_t lf = model_.final_layer();
    // The logits buffer is free now; it receives dlogits.
    ops_.softmax_xent_backward(logits_, probs_, targets_, dloss / static_cast<T>(N), N, V);
    {  // LM head: the tied token embedding, first use.
      STRATA_ASSIGN_OR_RETURN(auto e, src.acquire_backward(0));
      ops_.zero(dln_, NC);
      ops_.matmul_backward(dln_, e.second + off(0, kWte), static_cast<T*>(nullptr), logits_, lnf_,
                           e.first + off(0, kWte), N, C, V);
      STRATA_RETURN_IF_ERROR(src.release_backward(0));
    }
    {
      STRATA_ASSIGN_OR_RETURN(auto f, src.acquire_backward(lf));
      const T* last = cfg_.n_layer > 0 ? acts_.back().residual3 : encoded_;
      ops_.zero(dres_, NC);
      ops_.layernorm_backward(dres_, f.second + off(lf, kLnfW), f.second + off(lf, kLnfB), dln_, last,
                              f.first + off(lf, kLnfW), lnf_mean_, lnf_rstd_, N, C);
      STRATA_RETURN_IF_ERROR(src.release_backward(lf));
    }
    for (int l = cfg_.n_layer - 1; l >= 0; --l) {
      const size_t li = model_.block_layer(l);
      STRATA_ASSIGN_OR_RETURN(auto pg, src.acquire_backward(li));
      const Acts& a = acts_[l];
      const T* residual_in = l == 0 ? encoded_ : acts_[l - 1].residual3;
      auto w = [&](int t) { return pg.first + off(li, t); };
      auto g = [&](int t) { return pg.second + off(li, t); };
      // dres_ holds d(residual3); residual3 = residual2 + fcproj.
      ops_.zero(dfch_gelu_, NC * 4);
      ops_.matmul_backward(dfch_gelu_, g(kFcProjW), g(kFcProjB), dres_, a.fch_gelu, w(kFcProjW), N, 4 * C, C);
      ops_.zero(dfch_, NC * 4);
      ops_.gelu_backward(dfch_, a.fch, dfch_gelu_, NC * 4);
      ops_.zero(dln_, NC);
      ops_.matmul_backward(dln_, g(kFcW), g(kFcB), dfch_, a.ln2, w(kFcW), N, C, 4 * C);
      // LayerNorm backward adds into dres_, which becomes d(residual2).
      ops_.layernorm_backward(dres_, g(kLn2W), g(kLn2B), dln_, a.residual2, w(kLn2W), a.ln2_mean, a.ln2_rstd,
                              N, C);
      ops_.zero(datty_, NC);
      ops_.matmul_backward(datty_, g(kAttnProjW), g(kAttnProjB), dres_, a.atty, w(kAttnProjW), N, C, C);
      ops_.zero(dqkv_, NC * 3);
      ops_.attention_backward(dqkv_, datt_, datty_, a.qkv, a.att, B_, T_, C, NH);
      ops_.zero(dln_, NC);
      ops_.matmul_backward(dln_, g(kQkvW), g(kQkvB), dqkv_, a.ln1, w(kQkvW), N, C, 3 * C);
      // ... and dres_ becomes d(residual_in).
      ops_.layernorm_backward(dres_, g(kLn1W), g(kLn1B), dln_, residual_in, w(kLn1W), a.ln1_mean, a.ln1_rstd,
                              N, C);
      STRATA_RETURN_IF_ERROR(src.release_backward(li));
    }
    {  // Token and position embeddings: the second use of layer 0.
      STRATA_ASSIGN_OR_RETURN(auto e, src.acquire_backward(0));
      ops_.encoder_backward(e.second + off(0, kWte), e.second + off(0, kWpe), dres_, tokens_, B_, T_, C);
      STRATA_RETURN_IF_ERROR(src.release_backward(0));
    }
    return Status::Ok();
  }

  int batch() const { return B_; }
  int seq() const { return T_; }

 private:
  struct Acts {
    T *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *att, *residual2, *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu,
        *residual3;
  };

  size_t off(size_t layer, int tensor) const {
    return model_.layers()[layer].params[static_cast<size_t>(tensor)].offset_elements;
  }

  template <typename U>
  Status get_bytes(U*& ptr, size_t bytes, std::string_view what) {
    STRATA_ASSIGN_OR_RETURN(void* p, device_.allocate(bytes, what));
    ptr = static_cast<U*>(p);
    owned_.emplace_back(p, bytes);
    return Status::Ok();
  }
  Status get(T*& ptr, size_t n, std::string_view what) { return get_bytes(ptr, n * sizeof(T), what); }

  const GptModel& model_;
  const GptConfig& cfg_;
  Ops& ops_;
  DeviceAllocator& device_;
  const int B_, T_;
  bool have_forward_ = false;
  std::vector<std::pair<void*, size_t>> owned_;  // pointer, bytes
  int32_t* tokens_ = nullptr;
  int32_t* targets_ = nullptr;
  T* encoded_ = nullptr;
  std::vector<Acts> acts_;
  T *proj_ = nullptr, *lnf_ = nullptr, *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr;
  T *logits_ = nullptr, *probs_ = nullptr, *losses_ = nullptr;
  T *dres_ = nullptr, *dln_ = nullptr, *datty_ = nullptr, *dqkv_ = nullptr, *datt_ = nullptr;
  T *dfch_ = nullptr, *dfch_gelu_ = nullptr;
};

}  // namespace strata::model::detail
