#include "strata/model/gpt_reference.h"

#include <algorithm>

#include "cpu_backend.h"
#include "gpt_graph.h"

namespace strata::model {
namespace {

class ArraySource final : public detail::LayerSource<double> {
 public:
  ArraySource(std::vector<std::vector<double>>& params, std::vector<std::vector<double>>& grads)
      : params_(params), grads_(grads) {}
  Result<const double*> acquire_forward(size_t layer) override { return params_[layer].data(); }
  Status release_forward(size_t) override { return Status::Ok(); }
  Result<std::pair<const double*, double*>> acquire_backward(size_t layer) override {
    return std::pair<const double*, double*>(params_[layer].data(), grads_[layer].data());
  }
  Status release_backward(size_t) override { return Status::Ok(); }

 private:
  std::vector<std::vector<double>>& params_;
  std::vector<std::vector<double>>& grads_;
};

}  // namespace

struct GptReference::Impl {
  Impl(const GptModel& model, int B, int Tn, std::vector<std::vector<double>>& p,
       std::vector<std::vector<double>>& g)
      : device(ops, 0), graph(model, ops, device, B, Tn), source(p, g) {}
  detail::CpuOps<double> ops;
  detail::CountingAllocator<detail::CpuOps<double>> device;
  detail::GptGraph<double, detail::CpuOps<double>> graph;
  ArraySource source;
};

GptReference::GptReference(const GptModel& model) : model_(model) {}
GptReference::~GptReference() = default;

Result<std::unique_ptr<GptReference>> GptReference::create(const GptModel& model, int batch, int seq_len) {
  if (batch < 1 || seq_len < 1 || seq_len > model.config().max_seq_len)
    return InvalidArgument(fmt::format("GptReference: batch {} / seq {} invalid (max_seq {})", batch, seq_len,
                                       model.config().max_seq_len));
  std::unique_ptr<GptReference> ref(new GptReference(model));
  for (size_t i = 0; i < model.layers().size(); ++i) {
    const size_t n = model.layers()[i].param_count;
    ref->params_.emplace_back(n);
    ref->grads_.emplace_back(n, 0.0);
    model.init_layer_values(i, std::span<double>(ref->params_.back()));
  }
  ref->impl_ = std::make_unique<Impl>(model, batch, seq_len, ref->params_, ref->grads_);
  STRATA_RETURN_IF_ERROR(ref->impl_->graph.allocate());
  return ref;
}

void GptReference::zero_grads() {
  for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0);
}

Result<double> GptReference::forward(std::span<const int32_t> tokens, std::span<const int32_t> targets) {
  const size_t want = static_cast<size_t>(impl_->graph.batch()) * impl_->graph.seq();
  if (tokens.size() != want || targets.size() != want)
    return InvalidArgument(fmt::format("GptReference: need {} tokens and targets", want));
  for (size_t i = 0; i < want; ++i)
    if (tokens[i] < 0 || tokens[i] >= model_.config().vocab_size || targets[i] < 0 ||
        targets[i] >= model_.config().vocab_size)
      return InvalidArgument(fmt::format("GptReference: id at {} outside the vocabulary", i));
  double loss = 0;
  STRATA_RETURN_IF_ERROR(impl_->graph.forward(tokens.data(), targets.data(), impl_->source, &loss, true));
  return loss;
}

Status GptReference::backward(double dloss) { return impl_->graph.backward(dloss, impl_->source); }

}  // namespace strata::model
