#pragma once
// GptExecutor over a streamed float Ops backend (StreamCpuOps, CudaOps): a
// LayerSource that turns ParameterProvider acquisitions into stream-gated
// fp32 working copies, and the executor that owns the graph. See Note
// [Executor on a stream] in strata/model/gpt_executor.h.
#include <map>
#include <unordered_map>
#include <vector>

#include "gpt_graph.h"
#include "strata/core/device.h"
#include "strata/core/units.h"
#include "strata/model/gpt_executor.h"

namespace strata::model::detail {

// Device memory from the executor's strata::Device, counted in its device
// tier under its capacity.
class CoreDeviceAllocator final : public DeviceAllocator {
 public:
  explicit CoreDeviceAllocator(Device& device) : device_(device) {}
  ~CoreDeviceAllocator() override { buffers_.clear(); }
  Result<void*> allocate(size_t bytes, std::string_view what) override {
    Result<DeviceBuffer> buf = device_.allocate(bytes);
    if (!buf.ok())
      return buf.status().with_context(fmt::format("allocating {} for {} on the {} device (lower --batch or --seq, or "
                                                   "raise --device-memory)",
                                                   format_bytes(bytes, true), what, device_.caps().backend));
    void* p = buf->data();
    buffers_.emplace(p, std::move(buf).value());
    return p;
  }
  void free(void* ptr, size_t) override { buffers_.erase(ptr); }
  uint64_t current_bytes() const override { return device_.memory_stats().get(Tier::kDevice).current_bytes; }
  uint64_t peak_bytes() const override { return device_.memory_stats().get(Tier::kDevice).peak_bytes; }
  uint64_t capacity_bytes() const override { return device_.caps().memory_bytes; }

 private:
  Device& device_;
  std::unordered_map<void*, DeviceBuffer> buffers_;
};

template <typename Ops>
class ProviderSource final : public LayerSource<float> {
 public:
  ProviderSource(const GptModel& model, Ops& ops, DeviceAllocator& device, Stream& stream)
      : model_(model), ops_(ops), device_(device), stream_(stream) {}
  ~ProviderSource() override {
    for (auto& [count, list] : pool_)
      for (float* p : list) device_.free(p, count * sizeof(float));
  }
  // `forward_pass` is what acquire_forward asks for: kForward or kEval.
  void bind(ParameterProvider* provider, Pass forward_pass = Pass::kForward) {
    provider_ = provider;
    forward_pass_ = forward_pass;
  }

  Result<const float*> acquire_forward(size_t layer) override {
    STRATA_ASSIGN_OR_RETURN(Held h, acquire(layer, forward_pass_));
    return static_cast<const float*>(h.params);
  }
  Status release_forward(size_t layer) override { return release(layer, forward_pass_); }
  Result<std::pair<const float*, float*>> acquire_backward(size_t layer) override {
    STRATA_ASSIGN_OR_RETURN(Held h, acquire(layer, Pass::kBackward));
    return std::pair<const float*, float*>(h.params, h.grads);
  }
  Status release_backward(size_t layer) override { return release(layer, Pass::kBackward); }

 private:
  struct Held {
    Pass pass;
    LayerMemory mem;
    float* params = nullptr;
    float* grads = nullptr;
    bool params_owned = false;
    bool grads_owned = false;
  };

  static bool all_fp32(const LayerSpec& spec) {
    for (const ParamTensorSpec& t : spec.params)
      if (t.dtype != DType::kF32) return false;
    return true;
  }

  // Working copies are reused in stream order: a copy given back at a
  // release is only touched again by work enqueued after that release.
  Result<float*> take(size_t count, std::string_view what) {
    auto& list = pool_[count];
    if (!list.empty()) {
      float* p = list.back();
      list.pop_back();
      return p;
    }
    STRATA_ASSIGN_OR_RETURN(void* p, device_.allocate(count * sizeof(float), what));
    return static_cast<float*>(p);
  }
  void give_back(size_t count, float* p) { pool_[count].push_back(p); }

  Status check(const LayerSpec& spec, Pass pass, const LayerMemory& mem) const {
    auto bad = [&](std::string_view what) {
      return InvalidArgument(fmt::format("ParameterProvider handed layer '{}' ({} pass) {}", spec.name,
                                         pass_name(pass), what));
    };
    if (mem.params == nullptr) return bad("null parameters");
    if (mem.params_tier == Tier::kNvme) return bad("parameters on the nvme tier; the model reads device or host memory");
    if (pass != Pass::kBackward) return Status::Ok();
    if (mem.grads == nullptr) return bad("null gradients");
    if (mem.grads_tier == Tier::kNvme) return bad("gradients on the nvme tier; the model writes device or host memory");
    if (mem.grad_dtype != DType::kF32 && mem.grad_dtype != DType::kBF16 && mem.grad_dtype != DType::kF16)
      return bad(fmt::format("gradient dtype {}; use fp32, bf16 or fp16", dtype_name(mem.grad_dtype)));
    return Status::Ok();
  }

  Result<Held> acquire(size_t layer, Pass pass) {
    if (provider_ == nullptr) return FailedPrecondition("executor: no ParameterProvider bound");
    const LayerSpec& spec = model_.layers()[layer];
    STRATA_ASSIGN_OR_RETURN(LayerMemory mem, provider_->acquire(layer, pass));
    STRATA_RETURN_IF_ERROR(check(spec, pass, mem));
    // Nothing below may read the layer before the provider says it is ready.
    if (Status st = stream_.wait(mem.ready); !st.ok())
      return st.with_context(fmt::format("waiting for layer '{}' ({} pass) to be ready", spec.name, pass_name(pass)));
    Held h{pass, mem};
    if (Ops::addressable(mem.params_tier) && all_fp32(spec)) {
      h.params = reinterpret_cast<float*>(mem.params);
    } else {
      STRATA_ASSIGN_OR_RETURN(h.params, take(spec.param_count, "parameter working copy"));
      h.params_owned = true;
      for (const ParamTensorSpec& t : spec.params)
        ops_.widen(h.params + t.offset_elements, mem.params + t.offset_bytes, t.dtype, static_cast<size_t>(t.numel()),
                   mem.params_tier);
    }
    if (pass == Pass::kBackward) {
      if (Ops::addressable(mem.grads_tier) && mem.grad_dtype == DType::kF32) {
        h.grads = static_cast<float*>(mem.grads);
      } else {
        STRATA_ASSIGN_OR_RETURN(h.grads, take(spec.param_count, "gradient working copy"));
        h.grads_owned = true;
        ops_.zero(h.grads, spec.param_count);
      }
    }
    held_[layer].push_back(h);
    return h;
  }

  Status release(size_t layer, Pass pass) {
    auto it = held_.find(layer);
    if (it == held_.end() || it->second.empty() || it->second.back().pass != pass)
      return Internal(fmt::format("release of layer {} ({}) without a matching acquire", layer, pass_name(pass)));
    Held h = it->second.back();
    it->second.pop_back();
    const size_t count = model_.layers()[layer].param_count;
    if (h.grads_owned) {
      ops_.accumulate(h.mem.grads, h.mem.grad_dtype, h.mem.grads_tier, h.grads, count);
      give_back(count, h.grads);
    }
    if (h.params_owned) give_back(count, h.params);
    STRATA_RETURN_IF_ERROR(ops_status(ops_));
    return provider_->release(layer, pass, stream_.record_completion());
  }

  const GptModel& model_;
  Ops& ops_;
  DeviceAllocator& device_;
  Stream& stream_;
  ParameterProvider* provider_ = nullptr;
  Pass forward_pass_ = Pass::kForward;
  std::map<size_t, std::vector<Held>> held_;
  std::map<size_t, std::vector<float*>> pool_;
};

template <typename Ops>
class ExecutorImpl final : public GptExecutor {
 public:
  ExecutorImpl(const GptModel& model, DeviceKind kind, Device& device, Stream& stream, int B, int Tn,
               std::unique_ptr<Ops> ops)
      : model_(model),
        kind_(kind),
        device_(device),
        stream_(stream),
        ops_(std::move(ops)),
        alloc_(device),
        graph_(model, *ops_, alloc_, B, Tn),
        source_(model, *ops_, alloc_, stream) {}
  // Enqueued work points into the graph's buffers and the staging vectors.
  ~ExecutorImpl() override { (void)stream_.synchronize(); }
  Status init() {
    const size_t n = static_cast<size_t>(graph_.batch()) * graph_.seq();
    staged_tokens_.resize(n);
    staged_targets_.resize(n);
    return graph_.allocate();
  }

  Result<float> forward(std::span<const int32_t> tokens, std::span<const int32_t> targets, ParameterProvider& params,
                        Pass pass) override {
    if (pass == Pass::kBackward)
      return InvalidArgument("executor: forward() takes Pass::kForward or Pass::kEval, not kBackward");
    STRATA_RETURN_IF_ERROR(check_ids(tokens, "tokens"));
    STRATA_RETURN_IF_ERROR(check_ids(targets, "targets"));
    // The previous forward synchronized, so no enqueued work reads the
    // staging vectors now (a pending backward reads only device buffers).
    std::copy(tokens.begin(), tokens.end(), staged_tokens_.begin());
    std::copy(targets.begin(), targets.end(), staged_targets_.begin());
    source_.bind(&params, pass);
    Status st = graph_.forward(staged_tokens_.data(), staged_targets_.data(), source_, &loss_, pass == Pass::kForward);
    source_.bind(nullptr);
    STRATA_RETURN_IF_ERROR(st);
    STRATA_RETURN_IF_ERROR(ops_status(*ops_));
    if (Status sync = stream_.synchronize(); !sync.ok()) return sync.with_context(fmt::format("{} pass", pass_name(pass)));
    return loss_;
  }
  Status backward(float dloss, ParameterProvider& params) override {
    source_.bind(&params);
    Status st = graph_.backward(dloss, source_);
    source_.bind(nullptr);
    STRATA_RETURN_IF_ERROR(st);
    return ops_status(*ops_);
  }
  ExecutorMemory memory() const override {
    return {alloc_.current_bytes(), alloc_.peak_bytes(), alloc_.capacity_bytes()};
  }
  int batch() const override { return graph_.batch(); }
  int seq_len() const override { return graph_.seq(); }
  DeviceKind device_kind() const override { return kind_; }
  Device& device() const override { return device_; }
  Stream& stream() const override { return stream_; }

 private:
  Status check_ids(std::span<const int32_t> ids, std::string_view what) const {
    const size_t want = static_cast<size_t>(graph_.batch()) * graph_.seq();
    if (ids.size() != want)
      return InvalidArgument(fmt::format("executor: {} has {} ids but batch {} x seq {} needs {}", what, ids.size(),
                                         graph_.batch(), graph_.seq(), want));
    const int V = model_.config().vocab_size;
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0 || ids[i] >= V)
        return InvalidArgument(fmt::format("executor: {}[{}] = {} is outside the vocabulary [0, {}); check the "
                                           "tokenizer and --vocab",
                                           what, i, ids[i], V));
    return Status::Ok();
  }

  const GptModel& model_;
  DeviceKind kind_;
  Device& device_;
  Stream& stream_;
  std::unique_ptr<Ops> ops_;
  CoreDeviceAllocator alloc_;
  GptGraph<float, Ops> graph_;
  ProviderSource<Ops> source_;
  std::vector<int32_t> staged_tokens_, staged_targets_;
  float loss_ = 0;  // written by stream work, read after synchronize
};

}  // namespace strata::model::detail
