// End-to-end: the tiny preset learns the shipped corpus (validation loss
// clearly below the unigram baseline) and training is deterministic.
#include <gtest/gtest.h>

#include <cmath>

#include "strata/model/trainer.h"

namespace strata::model {
namespace {

TrainOptions tiny_options() {
  TrainOptions o;
  o.batch = 8;
  o.seq_len = 64;
  o.hyper.lr = 3e-3;
  o.grad_clip = 1.0;
  o.seed = 1234;
  o.eval_batches = 4;
  return o;
}

TEST(Train, TinyPresetBeatsUnigramBaseline) {
  auto data = TextDataset::load(default_corpus_path(), 64).value();
  const double baseline = data.unigram_baseline();
  auto trainer = Trainer::create(*preset("tiny"), tiny_options(), data).value();
  const double before = trainer->evaluate().value();
  EXPECT_NEAR(before, std::log(256.0), 0.2);  // untrained: about uniform
  const int steps = 200;  // ~7 s on an idle 2-core machine
  for (int i = 0; i < steps; ++i) {
    auto r = trainer->step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_TRUE(std::isfinite(r->loss));
  }
  const double after = trainer->evaluate().value();
  std::printf("unigram baseline %.4f nats, val loss %.4f -> %.4f after %d steps\n", baseline, before, after, steps);
  EXPECT_LT(after, baseline - 0.25);
}

TEST(Train, SameSeedSameLossesAcrossRuns) {
  auto data = TextDataset::load(default_corpus_path(), 32).value();
  TrainOptions o = tiny_options();
  o.seq_len = 32;
  o.batch = 4;
  o.grad_accum = 2;
  std::vector<double> runs[3];
  for (int run = 0; run < 3; ++run) {
    if (run == 2) o.seed = 99;
    auto t = Trainer::create(*preset("tiny"), o, data).value();
    for (int i = 0; i < 5; ++i) runs[run].push_back(t->step().value().loss);
    runs[run].push_back(t->evaluate().value());
  }
  EXPECT_EQ(runs[0], runs[1]);  // bit for bit
  EXPECT_NE(runs[0], runs[2]);
}

TEST(Train, Bf16AndFp16ParametersTrain) {
  auto data = TextDataset::load(default_corpus_path(), 32).value();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    GptConfig c = *preset("tiny");
    c.param_dtype = dt;
    TrainOptions o = tiny_options();
    o.seq_len = 32;
    auto t = Trainer::create(c, o, data).value();
    const double first = t->step().value().loss;
    double last = first;
    for (int i = 0; i < 40; ++i) last = t->step().value().loss;
    EXPECT_LT(last, first - 0.5) << dtype_name(dt);
    EXPECT_GT(t->host_bytes(), 0u);
  }
}

TEST(Train, BadOptionsAreRejected) {
  auto data = TextDataset::load(default_corpus_path(), 32).value();
  TrainOptions o = tiny_options();
  o.hyper.lr = -1;
  auto r = Trainer::create(*preset("tiny"), o, data);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("lr"), std::string::npos) << r.status().message();
  o = tiny_options();
  o.grad_accum = 0;
  EXPECT_FALSE(Trainer::create(*preset("tiny"), o, data).ok());
}

}  // namespace
}  // namespace strata::model
