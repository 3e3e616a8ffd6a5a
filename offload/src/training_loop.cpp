#include "strata/offload/training_loop.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "strata/cpu_adam/grad_stats.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::offload {
namespace {

// Tensors of one layer that share a dtype and lie back to back.
struct TensorRun {
  size_t offset_bytes = 0, offset_elements = 0, count = 0;
  DType dtype = DType::kF32;
};

std::vector<TensorRun> runs_of(const LayerSpec& spec) {
  std::vector<TensorRun> runs;
  for (const ParamTensorSpec& t : spec.params) {
    const size_t n = static_cast<size_t>(t.numel());
    if (!runs.empty()) {
      TensorRun& r = runs.back();
      if (r.dtype == t.dtype && r.offset_elements + r.count == t.offset_elements &&
          r.offset_bytes + r.count * dtype_size(r.dtype) == t.offset_bytes) {
        r.count += n;
        continue;
      }
    }
    runs.push_back({t.offset_bytes, t.offset_elements, n, t.dtype});
  }
  return runs;
}

}  // namespace

// Optimizer state per layer. A layer is stepped in runs of tensors that
// share a dtype and lie back to back (one run per layer for a model whose
// layers have one dtype, such as the GPT), so every element sees exactly
// the same arithmetic as one call over the whole layer.
struct TrainingLoop::OptState {
  OptState(cpu_adam::CpuOptimizer o, MemoryStats& s) : optimizer(std::move(o)), stats(s) {}
  ~OptState() {
    if (bytes != 0) stats.on_free(Tier::kPageableHost, bytes);
  }
  cpu_adam::CpuOptimizer optimizer;
  MemoryStats& stats;
  struct Layer {
    std::vector<float> master;  // fp32 master weights (empty when every tensor is fp32)
    std::vector<float> m, v;
    std::vector<TensorRun> runs;
  };
  std::vector<Layer> layers;
  uint64_t bytes = 0;
};

TrainingLoop::TrainingLoop(ModelRunner& runner, const Device& device, const TrainingOptions& options)
    : runner_(runner), device_(device), options_(options) {}

TrainingLoop::~TrainingLoop() = default;

Result<std::unique_ptr<TrainingLoop>> TrainingLoop::create(ModelRunner& runner, const Device& device,
                                                           const TrainingOptions& options) {
  if (options.grad_accum < 1)
    return InvalidArgument(fmt::format("gradient accumulation steps {} must be at least 1", options.grad_accum));
  STRATA_RETURN_IF_ERROR(cpu_adam::validate_hyper_params(options.optimizer, options.hyper));
  if (!(options.grad_clip >= 0.0))
    return InvalidArgument(fmt::format("gradient clipping {} must be >= 0 (0 turns it off)", options.grad_clip));
  for (const LayerSpec& spec : runner.model().layers())
    for (const ParamTensorSpec& t : spec.params)
      if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16)
        return InvalidArgument(fmt::format("tensor '{}' has dtype {}; the optimizer steps fp32, bf16 or fp16 parameters",
                                           t.name, dtype_name(t.dtype)));

  std::unique_ptr<TrainingLoop> loop(new TrainingLoop(runner, device, options));
  const LayeredModel& model = runner.model();
  STRATA_ASSIGN_OR_RETURN(loop->provider_, ResidentProvider::create(model, loop->host_stats_));
  cpu_adam::OptimizerOptions oo;
  oo.kind = options.optimizer;
  oo.threads = options.optimizer_threads;
  STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer opt, cpu_adam::CpuOptimizer::create(oo));
  loop->opt_ = std::make_unique<OptState>(std::move(opt), loop->host_stats_);
  for (size_t i = 0; i < model.layers().size(); ++i) {
    const LayerSpec& spec = model.layers()[i];
    OptState::Layer l;
    l.runs = runs_of(spec);
    bool all_fp32 = true;
    for (const auto& r : l.runs) all_fp32 = all_fp32 && r.dtype == DType::kF32;
    if (!all_fp32) {
      l.master.resize(spec.param_count);
      STRATA_RETURN_IF_ERROR(model.init_layer_fp32(i, std::span<float>(l.master)));
    }
    l.m.assign(spec.param_count, 0.0f);
    l.v.assign(spec.param_count, 0.0f);
    const uint64_t bytes = (l.master.size() + l.m.size() + l.v.size()) * sizeof(float);
    loop->opt_->bytes += bytes;
    loop->host_stats_.on_allocate(Tier::kPageableHost, bytes);
    loop->opt_->layers.push_back(std::move(l));
  }
  return loop;
}

uint64_t TrainingLoop::host_bytes() const { return provider_->bytes() + opt_->bytes; }

Result<StepResult> TrainingLoop::step() {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  ResidentProvider& params = *provider_;
  STRATA_RETURN_IF_ERROR(params.begin_step());
  double loss_sum = 0;
  const float dloss = 1.0f / static_cast<float>(options_.grad_accum);
  for (int micro = 0; micro < options_.grad_accum; ++micro) {
    STRATA_ASSIGN_OR_RETURN(float loss, runner_.train_micro_batch(dloss, params));
    loss_sum += loss;
    STRATA_RETURN_IF_ERROR(params.end_micro_batch(micro == options_.grad_accum - 1));
  }
  STRATA_RETURN_IF_ERROR(params.wait_gradients().with_context("backward pass"));
  // Global gradient norm over every layer, then one clipped update per layer.
  cpu_adam::GradStats stats;
  for (size_t i = 0; i < params.layer_count(); ++i) {
    std::span<float> g = params.grads(i);
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
    STRATA_RETURN_IF_ERROR(optimizer_step(r.grad_norm));
  } else {
    r.step = step_;
  }
  const double seconds = std::chrono::duration<double>(clock::now() - t0).count();
  r.step_ms = seconds * 1e3;
  r.tokens_per_s = static_cast<double>(runner_.tokens_per_micro_batch()) * options_.grad_accum / seconds;
  r.peak_device_bytes = device_.memory_stats().get(Tier::kDevice).peak_bytes;
  r.peak_pinned_bytes = MemoryStats::process().get(Tier::kPinnedHost).peak_bytes;
  r.peak_host_bytes = host_stats_.get(Tier::kPageableHost).peak_bytes;
  r.peak_nvme_bytes = MemoryStats::process().get(Tier::kNvme).peak_bytes;
  return r;
}

Status TrainingLoop::optimizer_step(double grad_norm) {
  cpu_adam::StepArgs args;
  args.step = step_;
  args.hyper = options_.hyper;
  args.clip_coefficient = cpu_adam::clip_coefficient(grad_norm, options_.grad_clip);
  args.overflow_check = cpu_adam::OverflowCheck::kAssumeFinite;
  ResidentProvider& params = *provider_;
  for (size_t i = 0; i < params.layer_count(); ++i) {
    OptState::Layer& l = opt_->layers[i];
    std::span<std::byte> p = params.params(i);
    std::span<float> g = params.grads(i);
    for (const TensorRun& run : l.runs) {
      cpu_adam::StateSpans s;
      s.count = run.count;
      s.grads = g.data() + run.offset_elements;
      s.grad_dtype = DType::kF32;
      s.exp_avg = l.m.data() + run.offset_elements;
      s.exp_avg_sq = l.v.data() + run.offset_elements;
      if (run.dtype == DType::kF32) {
        s.params = reinterpret_cast<float*>(p.data() + run.offset_bytes);
      } else {
        s.params = l.master.data() + run.offset_elements;
        s.param_copy = p.data() + run.offset_bytes;
        s.param_copy_dtype = run.dtype;
      }
      STRATA_ASSIGN_OR_RETURN(cpu_adam::StepReport rep, opt_->optimizer.step(args, s));
      (void)rep;
    }
  }
  return Status::Ok();
}

Result<double> TrainingLoop::evaluate() {
  double sum = 0;
  const size_t count = runner_.eval_batch_count();
  for (size_t b = 0; b < count; ++b) {
    STRATA_ASSIGN_OR_RETURN(float loss, runner_.eval_batch(b, *provider_));
    sum += loss;
  }
  return sum / static_cast<double>(count);
}

}  // namespace strata::offload
