#pragma once
// GptExecutor over any float Ops backend: a LayerSource that turns
// ParameterProvider acquisitions into fp32 working copies on the device,
// and the executor that owns the graph.
#include <map>
#include <vector>

#include "gpt_graph.h"
#include "strata/model/gpt_executor.h"

namespace strata::model::detail {

template <typename Ops>
class ProviderSource final : public LayerSource<float> {
 public:
  ProviderSource(const GptModel& model, Ops& ops, DeviceAllocator& device)
      : model_(model), ops_(ops), device_(device) {}
  ~ProviderSource() override {
    for (auto& [count, list] : pool_)
      for (float* p : list) device_.free(p, count * sizeof(float));
  }
  void bind(ParameterProvider* provider) { provider_ = provider; }

  Result<const float*> acquire_forward(size_t layer) override {
    STRATA_ASSIGN_OR_RETURN(Held h, acquire(layer, Pass::kForward));
    return static_cast<const float*>(h.params);
  }
  Status release_forward(size_t layer) override { return release(layer, Pass::kForward); }
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

  Result<Held> acquire(size_t layer, Pass pass) {
    if (provider_ == nullptr) return FailedPrecondition("executor: no ParameterProvider bound");
    const LayerSpec& spec = model_.layers()[layer];
    STRATA_ASSIGN_OR_RETURN(LayerMemory mem, provider_->acquire(layer, pass));
    if (mem.params == nullptr || (pass == Pass::kBackward && mem.grads == nullptr))
      return Internal(fmt::format("ParameterProvider returned null {} for layer '{}' in the {} pass",
                                  mem.params == nullptr ? "parameters" : "gradients", spec.name, pass_name(pass)));
    Held h{pass, mem};
    if (Ops::kHostMemory && all_fp32(spec)) {
      h.params = reinterpret_cast<float*>(mem.params);
    } else {
      STRATA_ASSIGN_OR_RETURN(h.params, take(spec.param_count, "parameter working copy"));
      h.params_owned = true;
      for (const ParamTensorSpec& t : spec.params)
        ops_.widen(h.params + t.offset_elements, mem.params + t.offset_bytes, t.dtype,
                   static_cast<size_t>(t.numel()));
    }
    if (pass == Pass::kBackward) {
      if (Ops::kHostMemory) {
        h.grads = mem.grads;
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
      ops_.add_to_host(h.mem.grads, h.grads, count);
      give_back(count, h.grads);
    }
    if (h.params_owned) give_back(count, h.params);
    return provider_->release(layer, pass);
  }

  const GptModel& model_;
  Ops& ops_;
  DeviceAllocator& device_;
  ParameterProvider* provider_ = nullptr;
  std::map<size_t, std::vector<Held>> held_;
  std::map<size_t, std::vector<float*>> pool_;
};

template <typename Ops>
class ExecutorImpl final : public GptExecutor {
 public:
  // `device` outlives nothing here: the executor owns it (and `extra`,
  // e.g. the core Device behind it) and destroys it last.
  ExecutorImpl(const GptModel& model, DeviceKind kind, int B, int Tn, std::unique_ptr<Ops> ops,
               std::unique_ptr<DeviceAllocator> device, std::shared_ptr<void> extra = {})
      : model_(model), kind_(kind), extra_(std::move(extra)), ops_(std::move(ops)), device_(std::move(device)),
        graph_(model, *ops_, *device_, B, Tn), source_(model, *ops_, *device_) {}
  Status init() { return graph_.allocate(); }

  Result<float> forward(std::span<const int32_t> tokens, std::span<const int32_t> targets,
                        ParameterProvider& params) override {
    STRATA_RETURN_IF_ERROR(check_ids(tokens, "tokens"));
    STRATA_RETURN_IF_ERROR(check_ids(targets, "targets"));
    source_.bind(&params);
    Result<float> loss = graph_.forward(tokens.data(), targets.data(), source_);
    source_.bind(nullptr);
    STRATA_RETURN_IF_ERROR(ops_status(*ops_));
    return loss;
  }
  Status backward(float dloss, ParameterProvider& params) override {
    source_.bind(&params);
    Status st = graph_.backward(dloss, source_);
    source_.bind(nullptr);
    STRATA_RETURN_IF_ERROR(st);
    return ops_status(*ops_);
  }
  ExecutorMemory memory() const override {
    return {device_->current_bytes(), device_->peak_bytes(), device_->capacity_bytes()};
  }
  int batch() const override { return graph_.batch(); }
  int seq_len() const override { return graph_.seq(); }
  DeviceKind device() const override { return kind_; }

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
  std::shared_ptr<void> extra_;
  std::unique_ptr<Ops> ops_;
  std::unique_ptr<DeviceAllocator> device_;
  GptGraph<float, Ops> graph_;
  ProviderSource<Ops> source_;
};

}  // namespace strata::model::detail
