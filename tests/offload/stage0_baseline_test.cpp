// The stage-0 TrainingLoop driving the GPT through core's contract: the
// tiny preset learns the shipped corpus (validation loss clearly below the
// unigram baseline), training is deterministic, the provider hooks come in
// the documented order, evaluation asks for no gradients.
#include <gtest/gtest.h>

#include <cmath>

#include "strata/core/device_registry.h"
#include "strata/core/pinned_pool.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/gpt_runner.h"
#include "strata/model/text_data.h"
#include "strata/offload/training_loop.h"

namespace strata::offload {
namespace {

using model::GptConfig;
using model::TextDataset;

struct RunOptions {
  int batch = 8;
  int seq_len = 64;
  uint64_t seed = 1234;
  int eval_batches = 4;
  TrainingOptions loop;
  RunOptions() {
    loop.hyper.lr = 3e-3;
    loop.grad_clip = 1.0;
  }
};

// What apps/cmd_train.cpp builds: device, stream, model, executor, runner, loop.
struct Stack {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<model::GptModel> model;
  std::unique_ptr<model::GptExecutor> executor;
  std::unique_ptr<model::GptRunner> runner;
  std::unique_ptr<TrainingLoop> loop;
};

Result<Stack> make_stack(const GptConfig& config, const RunOptions& o, const TextDataset& data) {
  Stack s;
  STRATA_ASSIGN_OR_RETURN(s.device, make_device("cpu"));
  STRATA_ASSIGN_OR_RETURN(s.stream, s.device->create_stream());
  STRATA_ASSIGN_OR_RETURN(s.model, model::GptModel::create(config, o.seed));
  STRATA_ASSIGN_OR_RETURN(s.executor,
                          model::GptExecutor::create(*s.model, *s.device, *s.stream, o.batch, o.seq_len));
  STRATA_ASSIGN_OR_RETURN(s.runner, model::GptRunner::create(*s.model, *s.executor, data, o.seed, o.eval_batches));
  STRATA_ASSIGN_OR_RETURN(s.loop, TrainingLoop::create(*s.runner, *s.device, o.loop));
  return s;
}

TEST(TrainingLoop, TinyPresetBeatsUnigramBaseline) {
  auto data = TextDataset::load(model::default_corpus_path(), 64).value();
  const double baseline = data.unigram_baseline();
  Stack s = make_stack(*model::preset("tiny"), RunOptions(), data).value();
  const double before = s.loop->evaluate().value();
  EXPECT_NEAR(before, std::log(256.0), 0.2);  // untrained: about uniform
  const int steps = 200;  // ~7 s on an idle 2-core machine
  for (int i = 0; i < steps; ++i) {
    auto r = s.loop->step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_TRUE(std::isfinite(r->loss));
  }
  const double after = s.loop->evaluate().value();
  std::printf("unigram baseline %.4f nats, val loss %.4f -> %.4f after %d steps\n", baseline, before, after, steps);
  EXPECT_LT(after, baseline - 0.25);
}

TEST(TrainingLoop, SameSeedSameLossesAcrossRuns) {
  auto data = TextDataset::load(model::default_corpus_path(), 32).value();
  RunOptions o;
  o.seq_len = 32;
  o.batch = 4;
  o.loop.grad_accum = 2;
  std::vector<double> runs[3];
  for (int run = 0; run < 3; ++run) {
    if (run == 2) o.seed = 99;
    Stack s = make_stack(*model::preset("tiny"), o, data).value();
    for (int i = 0; i < 5; ++i) runs[run].push_back(s.loop->step().value().loss);
    runs[run].push_back(s.loop->evaluate().value());
  }
  EXPECT_EQ(runs[0], runs[1]);  // bit for bit
  EXPECT_NE(runs[0], runs[2]);
}

TEST(TrainingLoop, Bf16AndFp16ParametersTrain) {
  auto data = TextDataset::load(model::default_corpus_path(), 32).value();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    GptConfig c = *model::preset("tiny");
    c.param_dtype = dt;
    RunOptions o;
    o.seq_len = 32;
    Stack s = make_stack(c, o, data).value();
    const double first = s.loop->step().value().loss;
    double last = first;
    for (int i = 0; i < 40; ++i) last = s.loop->step().value().loss;
    EXPECT_LT(last, first - 0.5) << dtype_name(dt);
    EXPECT_GT(s.loop->host_bytes(), 0u);
  }
}

TEST(TrainingLoop, BadOptionsAreRejected) {
  auto data = TextDataset::load(model::default_corpus_path(), 32).value();
  RunOptions o;
  o.loop.hyper.lr = -1;
  auto r = make_stack(*model::preset("tiny"), o, data);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("lr"), std::string::npos) << r.status().message();
  o = RunOptions();
  o.loop.grad_accum = 0;
  EXPECT_FALSE(make_stack(*model::preset("tiny"), o, data).ok());
  o = RunOptions();
  o.loop.grad_clip = -1;
  EXPECT_FALSE(make_stack(*model::preset("tiny"), o, data).ok());
  o = RunOptions();
  o.eval_batches = 0;
  EXPECT_FALSE(make_stack(*model::preset("tiny"), o, data).ok());
}

// Note [Steps and micro-batches]: begin_step, then per micro-batch its
// forward and backward hooks and end_micro_batch(last on the final one);
// an evaluation pass is kEval acquires only, no gradient buffer.
TEST(TrainingLoop, ProviderHooksComeInOrder) {
  auto data = TextDataset::load(model::default_corpus_path(), 8).value();
  GptConfig c = *model::preset("tiny");
  c.n_layer = 1;
  RunOptions o;
  o.batch = 1;
  o.seq_len = 8;
  o.eval_batches = 1;
  o.loop.grad_accum = 3;
  Stack s = make_stack(c, o, data).value();
  ResidentProvider& p = s.loop->provider();
  p.set_recording(true);
  ASSERT_TRUE(s.loop->step().ok());
  using E = HookEvent;
  using K = HookEvent::Kind;
  const auto& ev = p.events();
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.front(), E::begin_step());
  std::vector<E> brackets;
  for (const E& e : ev)
    if (e.kind == K::kBeginStep || e.kind == K::kEndMicroBatch) brackets.push_back(e);
  EXPECT_EQ(brackets, (std::vector<E>{E::begin_step(), E::end_micro_batch(false), E::end_micro_batch(false),
                                      E::end_micro_batch(true)}));
  EXPECT_EQ(ev.back(), E::end_micro_batch(true));
  // Each micro-batch: forward acquires, then backward ones, before its end.
  size_t micro = 0;
  bool saw_backward = false;
  for (const E& e : ev) {
    if (e.kind == K::kEndMicroBatch) {
      EXPECT_TRUE(saw_backward) << "micro-batch " << micro << " ended without a backward";
      saw_backward = false;
      ++micro;
    } else if (e.kind == K::kAcquire && e.pass == Pass::kBackward) {
      saw_backward = true;
    } else if (e.kind == K::kAcquire) {
      EXPECT_FALSE(saw_backward) << "a forward acquire after the backward of micro-batch " << micro;
    }
  }
  EXPECT_EQ(micro, 3u);

  p.clear_events();
  ASSERT_TRUE(s.loop->evaluate().ok());
  ASSERT_FALSE(p.events().empty());
  for (const E& e : p.events()) {
    EXPECT_TRUE(e.kind == K::kAcquire || e.kind == K::kRelease);
    EXPECT_EQ(e.pass, Pass::kEval);
  }
}

TEST(TrainingLoop, PeaksAreTheRealTiers) {
  auto data = TextDataset::load(model::default_corpus_path(), 16).value();
  RunOptions o;
  o.batch = 2;
  o.seq_len = 16;
  Stack s = make_stack(*model::preset("tiny"), o, data).value();
  // Host memory pinned anywhere in the process (here: a pinned pool, as the
  // engine's staging will be) shows in the peak.
  constexpr size_t kPinned = 64 << 10;  // within the smallest RLIMIT_MEMLOCK
  PinnedPoolOptions po;
  po.allow_pageable_fallback = false;
  auto pool = PinnedPool::create(s.device.get(), po).value();
  Result<PinnedBuffer> pinned = pool->allocate(kPinned);
  if (!pinned.ok()) GTEST_SKIP() << "cannot pin memory here: " << pinned.status().to_string();
  StepResult r = s.loop->step().value();
  pinned->reset();
  EXPECT_EQ(r.peak_device_bytes, s.device->memory_stats().get(Tier::kDevice).peak_bytes);
  EXPECT_GT(r.peak_device_bytes, 0u);
  EXPECT_GE(r.peak_pinned_bytes, kPinned);
  EXPECT_EQ(r.peak_pinned_bytes, MemoryStats::process().get(Tier::kPinnedHost).peak_bytes);
  EXPECT_EQ(r.peak_nvme_bytes, MemoryStats::process().get(Tier::kNvme).peak_bytes);
  EXPECT_EQ(r.peak_host_bytes, s.loop->host_bytes());
}

}  // namespace
}  // namespace strata::offload
