#include "strata/model/trainer.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "strata/cpu_adam/grad_stats.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::model {

struct Trainer::OptState {
  explicit OptState(cpu_adam::CpuOptimizer o) : optimizer(std::move(o)) {}
  cpu_adam::CpuOptimizer optimizer;
  struct Layer {
    std::vector<float> master;  // fp32 master weights (empty when the params are fp32)
    std::vector<float> m, v;
  };
  std::vector<Layer> layers;
  uint64_t bytes = 0;
};

Trainer::~Trainer() = default;

Result<std::unique_ptr<Trainer>> Trainer::create(const GptConfig& config, const TrainOptions& options,
                                                 const TextDataset& data) {
  if (options.grad_accum < 1)
    return InvalidArgument(fmt::format("gradient accumulation steps {} must be at least 1", options.grad_accum));
  if (options.eval_batches < 1)
    return InvalidArgument(fmt::format("eval batches {} must be at least 1", options.eval_batches));
  STRATA_RETURN_IF_ERROR(cpu_adam::validate_hyper_params(options.optimizer, options.hyper));
  if (!(options.grad_clip >= 0.0))
    return InvalidArgument(fmt::format("gradient clipping {} must be >= 0 (0 turns it off)", options.grad_clip));
  if (data.train().size() <= static_cast<size_t>(options.seq_len) ||
      data.val().size() <= static_cast<size_t>(options.seq_len))
    return InvalidArgument(fmt::format("data '{}' is too short for --seq {}", data.name(), options.seq_len));

  std::unique_ptr<Trainer> t(new Trainer());
  t->options_ = options;
  t->data_ = &data;
  STRATA_ASSIGN_OR_RETURN(t->model_, GptModel::create(config, options.seed));
  STRATA_ASSIGN_OR_RETURN(t->params_, ResidentParameters::create(*t->model_));
  STRATA_ASSIGN_OR_RETURN(t->executor_, GptExecutor::create(*t->model_, options.device, options.batch,
                                                            options.seq_len, options.device_memory_bytes));
  cpu_adam::OptimizerOptions oo;
  oo.kind = options.optimizer;
  oo.threads = options.optimizer_threads;
  STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer opt, cpu_adam::CpuOptimizer::create(oo));
  t->opt_ = std::make_unique<OptState>(std::move(opt));
  for (size_t i = 0; i < t->model_->layers().size(); ++i) {
    const LayerSpec& spec = t->model_->layers()[i];
    OptState::Layer l;
    if (config.param_dtype != DType::kF32) {
      l.master.resize(spec.param_count);
      t->model_->init_layer_values(i, std::span<float>(l.master));
    }
    l.m.assign(spec.param_count, 0.0f);
    l.v.assign(spec.param_count, 0.0f);
    t->opt_->bytes += (l.master.size() + l.m.size() + l.v.size()) * sizeof(float);
    t->opt_->layers.push_back(std::move(l));
  }
  t->loader_ = std::make_unique<BatchLoader>(data.train(), options.batch, options.seq_len, options.seed);
  t->eval_count_ = std::min<size_t>(static_cast<size_t>(options.eval_batches),
                                    BatchLoader::eval_batches(data.val(), options.batch, options.seq_len));
  if (t->eval_count_ == 0)
    return InvalidArgument(fmt::format("validation split of '{}' ({} bytes) holds no batch of {} x {}; use a larger "
                                       "file or a smaller --batch/--seq",
                                       data.name(), data.val().size(), options.batch, options.seq_len));
  const size_t n = static_cast<size_t>(options.batch) * options.seq_len;
  t->inputs_.resize(n);
  t->targets_.resize(n);
  return t;
}

uint64_t Trainer::host_bytes() const { return params_->bytes() + opt_->bytes; }

Result<StepResult> Trainer::step() {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  params_->zero_grads();
  double loss_sum = 0;
  const float dloss = 1.0f / static_cast<float>(options_.grad_accum);
  for (int micro = 0; micro < options_.grad_accum; ++micro) {
    loader_->next(inputs_, targets_);
    STRATA_ASSIGN_OR_RETURN(float loss, executor_->forward(inputs_, targets_, *params_));
    loss_sum += loss;
    STRATA_RETURN_IF_ERROR(executor_->backward(dloss, *params_));
  }
  // Global gradient norm over every layer, then one clipped update per layer.
  cpu_adam::GradStats stats;
  for (size_t i = 0; i < params_->layer_count(); ++i) {
    std::span<float> g = params_->grads(i);
    STRATA_ASSIGN_OR_RETURN(cpu_adam::GradStats s, opt_->optimizer.grad_stats(g.data(), DType::kF32, g.size()));
    stats = cpu_adam::combine(stats, s);
  }
  StepResult r;
  r.step = step_ + 1;
  r.loss = loss_sum / options_.grad_accum;
  r.grad_norm = stats.norm();
  r.skipped = !stats.all_finite;
  if (!r.skipped) {
    ++step_;
    cpu_adam::StepArgs args;
    args.step = step_;
    args.hyper = options_.hyper;
    args.clip_coefficient = cpu_adam::clip_coefficient(r.grad_norm, options_.grad_clip);
    args.overflow_check = cpu_adam::OverflowCheck::kAssumeFinite;
    for (size_t i = 0; i < params_->layer_count(); ++i) {
      OptState::Layer& l = opt_->layers[i];
      std::span<std::byte> p = params_->params(i);
      std::span<float> g = params_->grads(i);
      cpu_adam::StateSpans s;
      s.count = g.size();
      s.grads = g.data();
      s.grad_dtype = DType::kF32;
      s.exp_avg = l.m.data();
      s.exp_avg_sq = l.v.data();
      if (l.master.empty()) {
        s.params = reinterpret_cast<float*>(p.data());
      } else {
        s.params = l.master.data();
        s.param_copy = p.data();
        s.param_copy_dtype = model_->config().param_dtype;
      }
      STRATA_ASSIGN_OR_RETURN(cpu_adam::StepReport rep, opt_->optimizer.step(args, s));
      (void)rep;
    }
  } else {
    r.step = step_;
  }
  const double seconds = std::chrono::duration<double>(clock::now() - t0).count();
  r.step_ms = seconds * 1e3;
  r.tokens_per_s = static_cast<double>(options_.batch) * options_.seq_len * options_.grad_accum / seconds;
  const ExecutorMemory mem = executor_->memory();
  r.peak_device_bytes = mem.device_peak_bytes;
  r.peak_host_bytes = host_bytes();
  return r;
}

Result<double> Trainer::evaluate() {
  double sum = 0;
  for (size_t b = 0; b < eval_count_; ++b) {
    BatchLoader::eval_batch(data_->val(), options_.batch, options_.seq_len, b, inputs_, targets_);
    STRATA_ASSIGN_OR_RETURN(float loss, executor_->forward(inputs_, targets_, *params_));
    sum += loss;
  }
  return sum / static_cast<double>(eval_count_);
}

}  // namespace strata::model
