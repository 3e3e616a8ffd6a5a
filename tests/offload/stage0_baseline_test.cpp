// The baseline every offloaded run is compared against: the ZeRO engine at
// stage 0 on one rank (Engine::create with a runner and a local
// communicator of world 1, as `strata train` builds it) driving the GPT
// through core's contract. The tiny preset learns the shipped corpus
// (validation loss clearly below the unigram baseline), training is
// deterministic, bf16 and fp16 parameters train on fp32 master weights, bad
// options are refused, and the peaks a step reports are the real tiers.
// Also the runner's side of Note [Steps and micro-batches], driven by hand
// on a ResidentProvider.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"
#include "strata/core/memory_stats.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/gpt_runner.h"
#include "strata/model/text_data.h"
#include "strata/offload/engine.h"
#include "strata/offload/resident_provider.h"

namespace strata::offload {
namespace {

using model::GptConfig;
using model::TextDataset;

struct RunOptions {
  int batch = 8;
  int seq_len = 64;
  uint64_t seed = 1234;
  int eval_batches = 4;
  EngineOptions engine;  // stage 0, everything on the device, one rank
  RunOptions() {
    engine.hyper.lr = 3e-3;
    engine.grad_clip = 1.0;
  }
};

// What apps/cmd_train.cpp builds for one rank: communicator, device, stream,
// model, executor, runner, engine (destroyed in the reverse order).
struct Stack {
  std::unique_ptr<comm::Communicator> comm;
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<model::GptModel> model;
  std::unique_ptr<model::GptExecutor> executor;
  std::unique_ptr<model::GptRunner> runner;
  std::unique_ptr<Engine> engine;
};

Result<Stack> make_stack(const GptConfig& config, const RunOptions& o, const TextDataset& data) {
  Stack s;
  STRATA_ASSIGN_OR_RETURN(auto group, comm::create_local_group(1));
  s.comm = std::move(group[0]);
  STRATA_ASSIGN_OR_RETURN(s.device, make_device("cpu"));
  STRATA_ASSIGN_OR_RETURN(s.stream, s.device->create_stream());
  STRATA_ASSIGN_OR_RETURN(s.model, model::GptModel::create(config, o.seed));
  STRATA_ASSIGN_OR_RETURN(s.executor,
                          model::GptExecutor::create(*s.model, *s.device, *s.stream, o.batch, o.seq_len));
  STRATA_ASSIGN_OR_RETURN(s.runner, model::GptRunner::create(*s.model, *s.executor, data, o.seed, o.eval_batches));
  STRATA_ASSIGN_OR_RETURN(s.engine, Engine::create(o.engine, *s.runner, *s.device, *s.comm));
  return s;
}

TEST(Stage0Baseline, TinyPresetBeatsUnigramBaseline) {
  auto data = TextDataset::load(model::default_corpus_path(), 64).value();
  const double baseline = data.unigram_baseline();
  Stack s = make_stack(*model::preset("tiny"), RunOptions(), data).value();
  ASSERT_EQ(s.engine->options().stage, 0);
  const double before = s.engine->evaluate().value();
  EXPECT_NEAR(before, std::log(256.0), 0.2);  // untrained: about uniform
  const int steps = 200;
  for (int i = 0; i < steps; ++i) {
    auto r = s.engine->step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_TRUE(std::isfinite(r->loss));
    ASSERT_FALSE(r->skipped);
  }
  const double after = s.engine->evaluate().value();
  std::printf("unigram baseline %.4f nats, val loss %.4f -> %.4f after %d steps\n", baseline, before, after, steps);
  EXPECT_LT(after, baseline - 0.25);
  EXPECT_EQ(s.engine->optimizer_steps(), steps);
}

TEST(Stage0Baseline, SameSeedSameLossesAcrossRuns) {
  auto data = TextDataset::load(model::default_corpus_path(), 32).value();
  RunOptions o;
  o.seq_len = 32;
  o.batch = 4;
  o.engine.grad_accum = 2;
  std::vector<double> runs[3];
  for (int run = 0; run < 3; ++run) {
    if (run == 2) o.seed = 99;
    Stack s = make_stack(*model::preset("tiny"), o, data).value();
    for (int i = 0; i < 5; ++i) runs[run].push_back(s.engine->step().value().loss);
    runs[run].push_back(s.engine->evaluate().value());
  }
  EXPECT_EQ(runs[0], runs[1]);  // bit for bit
  EXPECT_NE(runs[0], runs[2]);
}

// 16-bit parameters, fp32 gradients, no loss scaling: the optimizer steps
// fp32 master weights and writes the rounded copy back into the parameters.
TEST(Stage0Baseline, Bf16AndFp16ParametersTrain) {
  auto data = TextDataset::load(model::default_corpus_path(), 32).value();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    GptConfig c = *model::preset("tiny");
    c.param_dtype = dt;
    RunOptions o;
    o.seq_len = 32;
    Stack s = make_stack(c, o, data).value();
    const double first = s.engine->step().value().loss;
    double last = first;
    for (int i = 0; i < 40; ++i) {
      StepMetrics m = s.engine->step().value();
      ASSERT_FALSE(m.skipped) << dtype_name(dt) << " step " << m.step;
      last = m.loss;
    }
    EXPECT_LT(last, first - 0.5) << dtype_name(dt);
    // The master weights are fp32 state of their own: after 41 updates some
    // of them lie between two values of the parameters' dtype.
    const std::vector<float> master = s.engine->gather_state(0, Engine::StateKind::kMaster).value();
    size_t off_grid = 0;
    for (float v : master) {
      const float rounded = dt == DType::kBF16 ? bf16_bits_to_fp32(fp32_to_bf16_bits(v))
                                               : fp16_bits_to_fp32(fp32_to_fp16_bits(v));
      off_grid += rounded != v;
    }
    EXPECT_GT(off_grid, master.size() / 2) << dtype_name(dt);
  }
}

// The engine's own checks, each naming the option (its DeepSpeed key).
TEST(Stage0Baseline, BadOptionsAreRejected) {
  auto data = TextDataset::load(model::default_corpus_path(), 32).value();
  const GptConfig tiny = *model::preset("tiny");
  auto refused = [&](const RunOptions& o, const std::string& names) {
    Result<Stack> r = make_stack(tiny, o, data);
    if (r.ok()) return ::testing::AssertionFailure() << "accepted; expected an error naming '" << names << "'";
    if (r.status().code() != StatusCode::kInvalidArgument || r.status().message().find(names) == std::string::npos)
      return ::testing::AssertionFailure() << "expected InvalidArgument naming '" << names
                                           << "', got: " << r.status().to_string();
    return ::testing::AssertionSuccess();
  };
  RunOptions o;
  o.engine.hyper.lr = -1;
  EXPECT_TRUE(refused(o, "lr"));
  o = RunOptions();
  o.engine.grad_accum = 0;
  EXPECT_TRUE(refused(o, "gradient_accumulation_steps"));
  o = RunOptions();
  o.engine.grad_clip = -1;
  EXPECT_TRUE(refused(o, "gradient_clipping"));
  o = RunOptions();
  o.engine.grad_clip = std::nan("");
  EXPECT_TRUE(refused(o, "gradient_clipping"));
  o = RunOptions();
  o.engine.grad_dtype = DType::kI64;
  EXPECT_TRUE(refused(o, "gradient dtype"));
  o = RunOptions();
  o.engine.stage = 4;
  EXPECT_TRUE(refused(o, "zero_optimization.stage"));
  o = RunOptions();
  o.engine.offload_param = OffloadDevice::kCpu;  // parameters offloaded at stage 0
  EXPECT_TRUE(refused(o, "offload_param needs stage 3"));
  // The runner's own check, before the engine is built.
  o = RunOptions();
  o.eval_batches = 0;
  EXPECT_FALSE(make_stack(tiny, o, data).ok());
}

// Peaks a step reports: device from the model's Device (the model's
// activations and the engine's state), pinned, pageable host and nvme from
// the engine's own stats, which feed the process's.
TEST(Stage0Baseline, PeaksAreTheRealTiers) {
  auto data = TextDataset::load(model::default_corpus_path(), 16).value();
  RunOptions o;
  o.batch = 2;
  o.seq_len = 16;
  Stack s = make_stack(*model::preset("tiny"), o, data).value();
  StepMetrics r = s.engine->step().value();
  ASSERT_TRUE(s.engine->synchronize().ok());
  const EngineMemory engine = s.engine->measured_memory();
  EXPECT_EQ(r.peak_device_bytes, s.device->memory_stats().get(Tier::kDevice).peak_bytes);
  EXPECT_GT(engine.device, 0u) << "stage 0: parameters, gradients and optimizer state on the device";
  EXPECT_GT(r.peak_device_bytes, engine.device) << "the model's activations come on top of the engine's state";
  EXPECT_EQ(r.peak_pinned_bytes, engine.pinned);
  EXPECT_EQ(r.peak_nvme_bytes, engine.nvme);
  EXPECT_EQ(r.peak_nvme_bytes, 0u) << "nothing on NVMe at stage 0";
  EXPECT_LE(r.peak_pinned_bytes, MemoryStats::process().get(Tier::kPinnedHost).peak_bytes);
  EXPECT_LE(r.peak_host_bytes, MemoryStats::process().get(Tier::kPageableHost).peak_bytes);
}

// Note [Steps and micro-batches], the runner's side: a driver brackets the
// micro-batches (begin_step, then end_micro_batch(last on the final one));
// the runner adds no bracket of its own, runs each micro-batch's forward
// before its backward and holds no layer past the micro-batch; an
// evaluation is kEval acquires only, no gradient buffer. Driven here by hand
// on a recording ResidentProvider (the engine is its own provider and
// checks its bracket itself: Note [Driving the engine]).
TEST(RunnerHooks, ComeInOrderInsideTheDriversBracket) {
  auto data = TextDataset::load(model::default_corpus_path(), 8).value();
  GptConfig c = *model::preset("tiny");
  c.n_layer = 1;
  auto device = make_device("cpu").value();
  auto stream = device->create_stream().value();
  auto gpt = model::GptModel::create(c, 1234).value();
  auto exec = model::GptExecutor::create(*gpt, *device, *stream, 1, 8).value();
  auto runner = model::GptRunner::create(*gpt, *exec, data, 1234, 1).value();
  MemoryStats stats;
  auto p = ResidentProvider::create(*gpt, stats).value();
  p->set_recording(true);
  const int grad_accum = 3;
  ASSERT_TRUE(p->begin_step().ok());
  for (int k = 0; k < grad_accum; ++k) {
    ASSERT_TRUE(runner->train_micro_batch(1.0f / grad_accum, *p).ok());
    ASSERT_TRUE(p->end_micro_batch(k == grad_accum - 1).ok());
  }
  ASSERT_TRUE(p->wait_gradients().ok());
  using E = HookEvent;
  using K = HookEvent::Kind;
  const auto& ev = p->events();
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.front(), E::begin_step());
  std::vector<E> brackets;
  for (const E& e : ev)
    if (e.kind == K::kBeginStep || e.kind == K::kEndMicroBatch) brackets.push_back(e);
  EXPECT_EQ(brackets, (std::vector<E>{E::begin_step(), E::end_micro_batch(false), E::end_micro_batch(false),
                                      E::end_micro_batch(true)}))
      << "the runner called a bracket hook itself";
  EXPECT_EQ(ev.back(), E::end_micro_batch(true));
  // Each micro-batch: forward acquires, then backward ones, every acquire
  // released before its end, every layer used in both passes.
  size_t micro = 0;
  bool saw_backward = false;
  int held = 0;
  std::vector<int> forward_uses(gpt->layers().size()), backward_uses(gpt->layers().size());
  for (const E& e : ev) {
    if (e.kind == K::kEndMicroBatch) {
      EXPECT_TRUE(saw_backward) << "micro-batch " << micro << " ended without a backward";
      EXPECT_EQ(held, 0) << "micro-batch " << micro << " ended holding a layer";
      saw_backward = false;
      ++micro;
    } else if (e.kind == K::kAcquire) {
      ++held;
      EXPECT_NE(e.pass, Pass::kEval);
      if (e.pass == Pass::kBackward) {
        saw_backward = true;
        ++backward_uses[e.layer];
      } else {
        EXPECT_FALSE(saw_backward) << "a forward acquire after the backward of micro-batch " << micro;
        ++forward_uses[e.layer];
      }
    } else if (e.kind == K::kRelease) {
      --held;
    }
  }
  EXPECT_EQ(micro, static_cast<size_t>(grad_accum));
  for (size_t i = 0; i < forward_uses.size(); ++i) {
    EXPECT_GE(forward_uses[i], grad_accum) << "layer " << i;
    EXPECT_GE(backward_uses[i], grad_accum) << "layer " << i;
  }

  p->clear_events();
  ASSERT_TRUE(runner->eval_batch(0, *p).ok());
  ASSERT_FALSE(p->events().empty());
  for (const E& e : p->events()) {
    EXPECT_TRUE(e.kind == K::kAcquire || e.kind == K::kRelease);
    EXPECT_EQ(e.pass, Pass::kEval);
  }
}

}  // namespace
}  // namespace strata::offload
