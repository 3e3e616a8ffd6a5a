#pragma once
// The driven engine tests' harness (Note [Driving the engine] in engine.h):
// one rank of the MLP of mlp_model.h driven from the test (DrivenRank), and
// whole runs on local ranks (DrivenRun, drive()) with hooks to save and
// load checkpoints. Shared by driven_engine_test.cpp and
// driven_checkpoint_test.cpp.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "mlp_model.h"
#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"
#include "strata/core/spec_model.h"
#include "strata/offload/engine.h"

namespace strata::offload {
namespace {

using mlp::Batch;
using mlp::MlpModel;
using mlp::MlpOrder;
using mlp::MlpSpecOptions;
using mlp::ReferenceOptions;
using mlp::ReferenceTrainer;

constexpr uint64_t kInitSeed = 20240611;
constexpr uint64_t kDataSeed = 77;
constexpr int kBatch = 8;        // per rank and micro-batch
constexpr int kEvalBatches = 2;  // per rank

// A hung engine ends the test binary with a message instead of ctest's
// ten-minute timeout ("never hangs" is part of what is tested).
class Watchdog {
 public:
  Watchdog(std::string what, std::chrono::seconds limit) : what_(std::move(what)) {
    thread_ = std::thread([this, limit] {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
        std::fprintf(stderr, "driven_engine_test: '%s' did not finish within %lld s (hung); aborting\n", what_.c_str(),
                     static_cast<long long>(limit.count()));
        std::fflush(stderr);
        std::_Exit(3);
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::string what_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// ---------------------------------------------------------------- one rank of a driven run

// Options every driven run starts from: accumulation 2, clipping, AdamW with
// decay (so that the no-decay bias and the conditional layer's decay on its
// unused steps show).
// A synchronous save into `dir` (designated initializers that leave fields
// out warn under GCC 12's -Wextra).
[[maybe_unused]] CheckpointSaveOptions sync_save(const std::string& dir) {
  CheckpointSaveOptions save;
  save.dir = dir;
  save.sync = true;
  return save;
}

EngineOptions base_options() {
  EngineOptions o;
  o.grad_accum = 2;
  o.grad_clip = 2.5;  // the norms are ~3 on odd steps (the conditional layer runs), ~2 on even ones
  o.hyper.lr = 1e-2;
  o.hyper.weight_decay = 0.2;
  o.persistence_threshold = 0;  // stage 3: every layer partitioned
  o.source = "driven engine test";
  return o;
}

[[maybe_unused]] ReferenceOptions reference_options(const EngineOptions& o, int world, const MlpSpecOptions& spec) {
  ReferenceOptions r;
  r.world = world;
  r.grad_accum = o.grad_accum;
  r.batch = kBatch;
  r.data_seed = kDataSeed;
  r.lr = o.hyper.lr;
  r.beta1 = o.hyper.beta1;
  r.beta2 = o.hyper.beta2;
  r.eps = o.hyper.eps;
  r.weight_decay = o.hyper.weight_decay;
  r.grad_clip = o.grad_clip;
  r.spec = spec;
  return r;
}

// Where a test gives a step up (Engine::abandon_step).
enum class AbandonAt {
  kAfterBeginStep,       // before any micro-batch
  kMidForward,           // in the first micro-batch's forward, a layer held
  kAfterLastPasses,      // the last micro-batch's passes ran (reductions issued), not ended
  kAfterLastMicroBatch,  // every micro-batch ended (every reduction issued), finish_step() not called
};
[[maybe_unused]] const char* abandon_at_name(AbandonAt at) {
  switch (at) {
    case AbandonAt::kAfterBeginStep: return "after_begin_step";
    case AbandonAt::kMidForward: return "mid_forward";
    case AbandonAt::kAfterLastPasses: return "after_last_passes";
    case AbandonAt::kAfterLastMicroBatch: return "after_last_micro_batch";
  }
  return "?";
}

// A rank's device, model description, engine and MLP, driven by the test.
class DrivenRank {
 public:
  static Result<std::unique_ptr<DrivenRank>> create(const EngineOptions& opt, const MlpSpecOptions& spec,
                                                    comm::Communicator& comm) {
    auto d = std::unique_ptr<DrivenRank>(new DrivenRank());
    d->rank_ = comm.rank();
    d->spec_options_ = spec;
    DeviceOptions dopt;
    dopt.device_memory_bytes = uint64_t{64} << 20;
    STRATA_ASSIGN_OR_RETURN(d->device_, make_device(DeviceKind::kCpu, dopt));
    STRATA_ASSIGN_OR_RETURN(SpecModel m, SpecModel::create(mlp::layer_descriptions(spec)));
    d->spec_ = std::make_unique<SpecModel>(std::move(m));
    d->model_ = std::make_unique<MlpModel>(d->spec_->layers());
    d->init_ = mlp::initial_values(kInitSeed);
    d->frozen_init_ = mlp::to_bytes(d->init_[mlp::kFrozen], spec.dtype);
    STRATA_ASSIGN_OR_RETURN(d->engine_, Engine::create(opt, *d->spec_, *d->device_, comm));
    return d;
  }

  Engine& engine() { return *engine_; }
  const SpecModel& spec() const { return *spec_; }
  int rank() const { return rank_; }

  Status put_layer(size_t li) {
    const std::vector<std::byte> bytes = mlp::to_bytes(init_[li], spec_options_.dtype);
    return engine_->put_initial_layer(li, bytes, init_[li])
        .with_context(fmt::format("put_initial_layer({}) on rank {}", li, rank_));
  }
  Status put_all() {
    for (size_t li = 0; li < mlp::kLayerCount; ++li) STRATA_RETURN_IF_ERROR(put_layer(li));
    return Status::Ok();
  }

  // The model's passes of micro-batch `micro` of step `step` (no engine brackets).
  Result<double> passes(int64_t step, int micro, MlpOrder order = MlpOrder::kNatural) {
    const Batch b = mlp::make_batch(kDataSeed, step, micro, rank_, kBatch);
    Result<double> loss =
        model_->train_micro_batch(*engine_, b, mlp::cond_used(step), engine_->gradient_scale(), order);
    if (!loss.ok())
      return loss.status().with_context(
          fmt::format("step {} micro-batch {} ({} order) on rank {}", step, micro + 1, mlp::order_name(order), rank_));
    return loss;
  }

  // begin_micro_batch, the passes, end_micro_batch.
  Status micro_batch(int64_t step, int micro, MlpOrder order = MlpOrder::kNatural) {
    STRATA_RETURN_IF_ERROR(engine_->begin_micro_batch(micro == engine_->options().grad_accum - 1));
    STRATA_ASSIGN_OR_RETURN(double loss, passes(step, micro, order));
    return engine_->end_micro_batch(loss, kBatch);
  }

  // One whole step; an outcome other than applied is an error here.
  Result<StepMetrics> step(int64_t step, const std::function<MlpOrder(int micro)>& order = {}) {
    STRATA_RETURN_IF_ERROR(engine_->begin_step());
    for (int k = 0; k < engine_->options().grad_accum; ++k)
      STRATA_RETURN_IF_ERROR(micro_batch(step, k, order ? order(k) : MlpOrder::kNatural));
    STRATA_ASSIGN_OR_RETURN(StepOutcome out, engine_->finish_step());
    if (!out.applied())
      return Internal(fmt::format("step {} on rank {}: finish_step() says {} (state step {}): {}", step, rank_,
                                  step_outcome_name(out.kind), out.state_step, out.reason.to_string()));
    return out.metrics;
  }

  // Step `step` begun and given up at `at` (abandon_step()); the caller
  // then runs the step again.
  Status abandoned_step(int64_t step, AbandonAt at) {
    STRATA_RETURN_IF_ERROR(engine_->begin_step());
    const int last = engine_->options().grad_accum - 1;
    if (at == AbandonAt::kMidForward) {
      // The first micro-batch's forward fails after acquiring layer 0: the layer is still held.
      STRATA_RETURN_IF_ERROR(engine_->begin_micro_batch(last == 0));
      STRATA_RETURN_IF_ERROR(engine_->acquire(0, Pass::kForward).status());
    } else if (at != AbandonAt::kAfterBeginStep) {
      for (int k = 0; k < last; ++k) STRATA_RETURN_IF_ERROR(micro_batch(step, k));
      STRATA_RETURN_IF_ERROR(engine_->begin_micro_batch(true));
      // The last micro-batch's passes: its backward released every layer, so
      // their reductions were issued.
      STRATA_ASSIGN_OR_RETURN(double loss, passes(step, last));
      if (at == AbandonAt::kAfterLastMicroBatch) STRATA_RETURN_IF_ERROR(engine_->end_micro_batch(loss, kBatch));
    }
    return engine_->abandon_step().with_context(fmt::format("abandon_step() of step {} on rank {}", step, rank_));
  }

  // An evaluation of this rank's kEvalBatches batches; checks that the
  // frozen layer's bytes, as the engine hands them out, are its initial ones.
  Result<double> evaluate() {
    STRATA_RETURN_IF_ERROR(engine_->begin_evaluation());
    return evaluate_batches();
  }
  // The batches and finish_evaluation() of an evaluation already begun.
  Result<double> evaluate_batches() {
    double sum = 0;
    for (int i = 0; i < kEvalBatches; ++i) {
      const Batch b = mlp::make_eval_batch(kDataSeed, rank_ * kEvalBatches + i, kBatch);
      std::vector<std::byte> frozen;
      STRATA_ASSIGN_OR_RETURN(double loss, model_->eval_batch(*engine_, b, &frozen));
      if (frozen != frozen_init_) {
        size_t at = 0;
        while (at < frozen.size() && at < frozen_init_.size() && frozen[at] == frozen_init_[at]) ++at;
        return DataLoss(fmt::format("rank {}: the frozen layer's bytes changed (first differing byte {} of {})", rank_,
                                    at, frozen_init_.size()));
      }
      sum += loss;
    }
    return engine_->finish_evaluation(sum, kEvalBatches);
  }

 private:
  DrivenRank() = default;
  int rank_ = 0;
  MlpSpecOptions spec_options_;
  std::vector<std::vector<float>> init_;
  std::vector<std::byte> frozen_init_;
  // Destroyed in reverse: the engine before the model description and the device.
  std::unique_ptr<Device> device_;
  std::unique_ptr<SpecModel> spec_;
  std::unique_ptr<MlpModel> model_;
  std::unique_ptr<Engine> engine_;
};

// ---------------------------------------------------------------- whole runs on local ranks

struct DrivenRun {
  int world = 1;
  int steps = 12;
  EngineOptions opt = base_options();
  MlpSpecOptions spec;
  // The acquire order of (rank, step, micro-batch); null: natural.
  std::function<MlpOrder(int rank, int64_t step, int micro)> order;
  int eval_every = 4;  // and after the last step
  bool gather_masters = true;
  // The lr the caller sets for each step (Engine::set_step_lr); null: the config's.
  std::function<double(int64_t step)> step_lr;
  // Steps begun, given up there (abandon_step) and run again; null: none.
  std::function<std::optional<AbandonAt>(int64_t step)> abandon;
  // A checkpoint saved (sync) into save_dir after step save_at (0: none).
  std::string save_dir;
  int64_t save_at = 0;
  // A checkpoint loaded from load_dir after the initial values are put;
  // the run then goes from step first_step to steps.
  std::string load_dir;
  int64_t first_step = 1;
  std::string label = "run";
};

struct DrivenOutcome {
  Status status;
  std::vector<double> losses, grad_norms;   // rank 0's, per step
  std::vector<double> beta1s;               // rank 0's StepMetrics::beta1, per step
  std::vector<double> evals;                // after steps eval_every, 2 eval_every, ..., and the last
  std::vector<std::vector<float>> masters;  // rank 0's gather_state(kMaster) per layer (frozen: empty)
};

[[maybe_unused]] DrivenOutcome drive(const DrivenRun& run) {
  Watchdog dog(run.label, std::chrono::seconds(120));
  DrivenOutcome out;
  auto comms = comm::create_local_group(run.world).value();
  std::vector<Status> st(static_cast<size_t>(run.world));
  std::vector<std::thread> threads;
  for (int r = 0; r < run.world; ++r) {
    threads.emplace_back([&, r] {
      auto body = [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(auto d, DrivenRank::create(run.opt, run.spec, *comms[static_cast<size_t>(r)]));
        STRATA_RETURN_IF_ERROR(d->put_all());
        if (!run.load_dir.empty()) STRATA_RETURN_IF_ERROR(d->engine().load_checkpoint(run.load_dir).status());
        for (int64_t s = run.first_step; s <= run.steps; ++s) {
          std::function<MlpOrder(int)> order;
          if (run.order) order = [&, s](int micro) { return run.order(r, s, micro); };
          if (run.abandon)
            if (const std::optional<AbandonAt> at = run.abandon(s)) STRATA_RETURN_IF_ERROR(d->abandoned_step(s, *at));
          if (run.step_lr) STRATA_RETURN_IF_ERROR(d->engine().set_step_lr(run.step_lr(s)));
          STRATA_ASSIGN_OR_RETURN(StepMetrics m, d->step(s, order));
          if (r == 0) {
            out.losses.push_back(m.loss);
            out.grad_norms.push_back(m.grad_norm);
            out.beta1s.push_back(m.beta1);
          }
          if ((run.eval_every > 0 && s % run.eval_every == 0) || s == run.steps) {
            STRATA_ASSIGN_OR_RETURN(double v, d->evaluate());
            if (r == 0) out.evals.push_back(v);
          }
          if (s == run.save_at)
            STRATA_RETURN_IF_ERROR(d->engine().save_checkpoint(sync_save(run.save_dir)).status());
        }
        STRATA_RETURN_IF_ERROR(d->engine().synchronize());
        if (run.gather_masters) {
          if (r == 0) out.masters.resize(mlp::kLayerCount);
          for (size_t li = 0; li < mlp::kLayerCount; ++li) {
            if (li == mlp::kFrozen) continue;  // no master: checked through its bytes in evaluate()
            STRATA_ASSIGN_OR_RETURN(std::vector<float> v, d->engine().gather_state(li));
            if (r == 0) out.masters[li] = std::move(v);
          }
        }
        return Status::Ok();
      };
      st[static_cast<size_t>(r)] = body();
      if (!st[static_cast<size_t>(r)].ok()) comms[static_cast<size_t>(r)].reset();  // a failed rank leaves the group
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : st)
    if (!s.ok()) {
      out.status = s;
      break;
    }
  return out;
}

}  // namespace
}  // namespace strata::offload
