// The engine driven from outside (Note [Driving the engine] in engine.h) for
// a model that is not the GPT: the MLP of mlp_model.h (a frozen layer, a
// conditional layer used on odd steps only, a tied weight, a no-decay bias,
// an lr-scaled head), described by tensor specs (SpecModel), its initial
// values handed in layer by layer (put_initial_layer), every step driven
// from the test (begin_step, begin_micro_batch, end_micro_batch,
// finish_step):
//  - the MLP's hand-written backward against finite differences;
//  - losses, evaluation losses and final parameters equal a plain-loop fp32
//    reference (world 1 and 2) within 1e-5; the frozen layer's bytes never
//    change; the per-tensor weight decay and lr scale matter (a control run
//    without them differs, and matches its own reference);
//  - every stage x optimizer placement x parameter placement x overlap
//    setting at world 2 gives bit-identical losses, evaluation losses and
//    final parameters to stage 0 with overlap off (fp32 and bf16);
//  - out-of-order calls fail naming the call and leave the engine working
//    (the losses after them are those of a run without them);
//  - the acquire order is a hint: a step visiting layers in another order,
//    recomputing in backward, ranks visiting in different orders: same losses;
//  - SpecModel::create refuses bad descriptions naming the layer and tensor.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "driven_harness.h"
#include "mlp_model.h"
#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"
#include "strata/core/spec_model.h"
#include "strata/offload/engine.h"
#include "strata/offload/lr_schedule.h"

namespace strata::offload {
namespace {

// The reference's losses, evaluation losses (at the same points as
// drive()) and final parameters.
struct ReferenceOutcome {
  std::vector<double> losses, grad_norms, evals;
  std::vector<float> clips;
  std::vector<std::vector<float>> params;
};

ReferenceOutcome reference(const DrivenRun& run) {
  ReferenceTrainer t(reference_options(run.opt, run.world, run.spec), mlp::initial_values(kInitSeed));
  ReferenceOutcome out;
  for (int64_t s = 1; s <= run.steps; ++s) {
    out.losses.push_back(t.step(s));
    out.grad_norms.push_back(t.last_grad_norm());
    out.clips.push_back(t.last_clip());
    if ((run.eval_every > 0 && s % run.eval_every == 0) || s == run.steps) {
      double sum = 0;
      for (int r = 0; r < run.world; ++r)
        for (int i = 0; i < kEvalBatches; ++i)
          sum += t.eval(mlp::make_eval_batch(kDataSeed, r * kEvalBatches + i, kBatch));
      out.evals.push_back(sum / (run.world * kEvalBatches));
    }
  }
  for (size_t li = 0; li < mlp::kLayerCount; ++li) out.params.push_back(t.params(li));
  return out;
}

double rel_diff(double a, double b) { return std::abs(a - b) / std::max(1e-12, std::abs(b)); }

// Largest |a - b| over [begin, end) of two layers' values.
double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b, size_t begin = 0,
                    size_t end = std::numeric_limits<size_t>::max()) {
  end = std::min({end, a.size(), b.size()});
  double m = 0;
  for (size_t i = begin; i < end; ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

void expect_matches_reference(const DrivenOutcome& got, const ReferenceOutcome& want, const std::string& what) {
  ASSERT_TRUE(got.status.ok()) << what << ": " << got.status.to_string();
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_LE(rel_diff(got.losses[i], want.losses[i]), 1e-5)
        << what << ": step " << i + 1 << " loss " << fmt::format("{:.9g}", got.losses[i]) << " vs reference "
        << fmt::format("{:.9g}", want.losses[i]);
    EXPECT_LE(rel_diff(got.grad_norms[i], want.grad_norms[i]), 1e-5)
        << what << ": step " << i + 1 << " gradient norm " << got.grad_norms[i] << " vs reference "
        << want.grad_norms[i];
  }
  ASSERT_EQ(got.evals.size(), want.evals.size()) << what;
  for (size_t i = 0; i < want.evals.size(); ++i)
    EXPECT_LE(rel_diff(got.evals[i], want.evals[i]), 1e-5)
        << what << ": evaluation " << i + 1 << " " << got.evals[i] << " vs reference " << want.evals[i];
  ASSERT_EQ(got.masters.size(), mlp::kLayerCount) << what;
  for (size_t li = 0; li < mlp::kLayerCount; ++li) {
    if (li == mlp::kFrozen) continue;
    ASSERT_EQ(got.masters[li].size(), want.params[li].size()) << what << ": layer " << li;
    EXPECT_LE(max_abs_diff(got.masters[li], want.params[li]), 1e-5)
        << what << ": layer " << li << " parameters after training differ from the reference's";
  }
}

void expect_bit_identical(const DrivenOutcome& base, const DrivenOutcome& got, const std::string& what) {
  ASSERT_TRUE(got.status.ok()) << what << ": " << got.status.to_string();
  ASSERT_EQ(base.losses.size(), got.losses.size()) << what;
  for (size_t i = 0; i < base.losses.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint64_t>(base.losses[i]), std::bit_cast<uint64_t>(got.losses[i]))
        << what << ": step " << i + 1 << " loss " << fmt::format("{:.17g}", got.losses[i]) << " vs baseline "
        << fmt::format("{:.17g}", base.losses[i]);
  ASSERT_EQ(base.evals.size(), got.evals.size()) << what;
  for (size_t i = 0; i < base.evals.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint64_t>(base.evals[i]), std::bit_cast<uint64_t>(got.evals[i]))
        << what << ": evaluation " << i + 1 << " " << fmt::format("{:.17g}", got.evals[i]) << " vs baseline "
        << fmt::format("{:.17g}", base.evals[i]);
  ASSERT_EQ(base.masters.size(), got.masters.size()) << what;
  for (size_t li = 0; li < base.masters.size(); ++li) {
    ASSERT_EQ(base.masters[li].size(), got.masters[li].size()) << what << ": layer " << li;
    size_t differing = 0, first = 0;
    for (size_t i = 0; i < base.masters[li].size(); ++i)
      if (std::bit_cast<uint32_t>(base.masters[li][i]) != std::bit_cast<uint32_t>(got.masters[li][i]))
        if (differing++ == 0) first = i;
    EXPECT_EQ(differing, 0u) << what << ": layer " << li << " master weights: " << differing
                             << " elements differ from the baseline's, the first at " << first;
  }
}

// ---------------------------------------------------------------- the model's own math

// The hand-written backward against central differences (double), so that
// the reference the engine is compared with computes real gradients.
TEST(MlpModel, BackwardMatchesFiniteDifferences) {
  const std::vector<std::vector<float>> init = mlp::initial_values(kInitSeed);
  std::vector<std::vector<double>> p;
  for (const auto& v : init) p.emplace_back(v.begin(), v.end());
  const Batch b = mlp::make_batch(kDataSeed, 1, 0, 0, 4);
  for (bool cond : {true, false}) {
    auto weights = [&] {
      mlp::Weights<double> w;
      w.w0 = p[mlp::kEmbedIn].data();
      w.b0 = p[mlp::kEmbedIn].data() + mlp::kW0;
      w.w1 = p[mlp::kFrozen].data();
      w.w2 = p[mlp::kCond].data();
      w.wh = p[mlp::kHead].data();
      return w;
    };
    mlp::Activations<double> a;
    mlp::forward(weights(), b, cond, a);
    const mlp::Contributions<double> g = mlp::backward(weights(), b, cond, a, 1.0);
    auto analytic = [&](size_t li, size_t i) -> double {
      if (li == mlp::kEmbedIn) return i < mlp::kW0 ? g.w0_tie[i] + g.w0_enc[i] : g.b0[i - mlp::kW0];
      if (li == mlp::kCond) return cond ? g.w2[i] : 0.0;
      return g.wh[i];
    };
    for (size_t li : {size_t{mlp::kEmbedIn}, size_t{mlp::kCond}, size_t{mlp::kHead}}) {
      std::vector<size_t> elements;
      for (size_t i = 0; i < p[li].size(); i += 97) elements.push_back(i);  // a spread of elements
      if (li == mlp::kEmbedIn)
        for (size_t j : {size_t{0}, size_t{7}, mlp::kB0 - 1}) elements.push_back(mlp::kW0 + j);  // the bias
      for (size_t at : elements) {
        const double keep = p[li][at], h = 1e-6;
        mlp::Activations<double> t;
        p[li][at] = keep + h;
        const double up = mlp::forward(weights(), b, cond, t);
        p[li][at] = keep - h;
        const double down = mlp::forward(weights(), b, cond, t);
        p[li][at] = keep;
        const double fd = (up - down) / (2 * h);
        EXPECT_NEAR(analytic(li, at), fd, 1e-7 + 1e-5 * std::abs(fd))
            << "layer " << li << " element " << at << " cond " << cond;
      }
    }
  }
}

// OneCycle's cycle_momentum (issue 22, defect 9): beta1 follows the
// schedule step by step (what LrSchedule::betas says) and changes the
// training; with it off the config's beta1 stays.
TEST(DrivenEngineSchedule, OneCycleCycleMomentumSetsBeta1EveryStep) {
  auto one_cycle = [](bool cycle_momentum) {
    DrivenRun run;
    run.steps = 8;
    run.opt.scheduler.type = SchedulerType::kOneCycle;
    run.opt.scheduler.params = {{"cycle_min_lr", 1e-3},     {"cycle_max_lr", 1e-2},      {"cycle_first_step_size", 4},
                                {"cycle_momentum", cycle_momentum}, {"cycle_min_mom", 0.8}, {"cycle_max_mom", 0.95}};
    run.label = fmt::format("one cycle, cycle_momentum {}", cycle_momentum);
    return run;
  };
  const DrivenRun cycled_run = one_cycle(true), fixed_run = one_cycle(false);
  const DrivenOutcome cycled = drive(cycled_run), fixed = drive(fixed_run);
  ASSERT_TRUE(cycled.status.ok()) << cycled.status.to_string();
  ASSERT_TRUE(fixed.status.ok()) << fixed.status.to_string();
  LrSchedule schedule = LrSchedule::create(cycled_run.opt.scheduler, cycled_run.opt.hyper.lr, "test").value();
  ASSERT_EQ(cycled.beta1s.size(), 8u);
  for (size_t i = 0; i < cycled.beta1s.size(); ++i) {
    const auto betas = schedule.betas(static_cast<int64_t>(i) + 1);
    ASSERT_TRUE(betas.has_value());
    EXPECT_EQ(cycled.beta1s[i], (*betas)[0]) << "step " << i + 1;
    EXPECT_EQ(fixed.beta1s[i], fixed_run.opt.hyper.beta1) << "step " << i + 1;
  }
  EXPECT_NE(cycled.beta1s.front(), cycled.beta1s[3]) << "beta1 did not cycle";
  // The first update's moments start at zero, so they part from the second step on.
  EXPECT_EQ(cycled.losses.front(), fixed.losses.front());
  EXPECT_NE(cycled.losses.back(), fixed.losses.back()) << "cycle_momentum changed nothing";
}

// ---------------------------------------------------------------- 1. against the fp32 reference

TEST(DrivenEngineReference, World1Stage0MatchesPlainLoopsAndKeepsTheFrozenLayer) {
  DrivenRun run;
  run.label = "world 1 stage 0 reference";
  const ReferenceOutcome want = reference(run);
  // The premise: clipping is active on some steps and not on others.
  int clipped = 0;
  for (float c : want.clips) clipped += c < 1.0f;
  const std::string norms =
      fmt::format("gradient norms {:.4g} (clip at {})", fmt::join(want.grad_norms, " "), run.opt.grad_clip);
  ASSERT_GT(clipped, 0) << "no step clipped: lower grad_clip; " << norms;
  ASSERT_LT(clipped, static_cast<int>(want.clips.size())) << "every step clipped: raise grad_clip; " << norms;
  // It learns.
  EXPECT_LT(want.losses.back(), want.losses.front());
  const DrivenOutcome got = drive(run);
  expect_matches_reference(got, want, run.label);
}

TEST(DrivenEngineReference, NoDecayBiasAndLrScaleMatter) {
  DrivenRun run;
  run.label = "per-tensor hyper-parameters";
  DrivenRun control = run;
  control.label = "control: no per-tensor hyper-parameters";
  control.spec.bias_no_decay = false;
  control.spec.head_lr_scale = false;
  const ReferenceOutcome want = reference(run), want_control = reference(control);
  // They matter in the reference: the bias and the head end up visibly apart.
  const double bias_apart = max_abs_diff(want.params[mlp::kEmbedIn], want_control.params[mlp::kEmbedIn], mlp::kW0);
  const double head_apart = max_abs_diff(want.params[mlp::kHead], want_control.params[mlp::kHead]);
  ASSERT_GT(bias_apart, 1e-3);
  ASSERT_GT(head_apart, 1e-3);
  double loss_apart = 0;
  for (size_t i = 0; i < want.losses.size(); ++i)
    loss_apart = std::max(loss_apart, rel_diff(want_control.losses[i], want.losses[i]));
  ASSERT_GT(loss_apart, 1e-3);
  // The engine honours them: each run matches its own reference (1e-5), and
  // is therefore far from the other's.
  const DrivenOutcome got = drive(run), got_control = drive(control);
  expect_matches_reference(got, want, run.label);
  expect_matches_reference(got_control, want_control, control.label);
  ASSERT_TRUE(got.status.ok() && got_control.status.ok());
  if (got.masters.size() == mlp::kLayerCount && got_control.masters.size() == mlp::kLayerCount) {
    EXPECT_GT(max_abs_diff(got.masters[mlp::kEmbedIn], got_control.masters[mlp::kEmbedIn], mlp::kW0), 1e-3)
        << "the no-decay bias made no difference in the engine";
    EXPECT_GT(max_abs_diff(got.masters[mlp::kHead], got_control.masters[mlp::kHead]), 1e-3)
        << "the head's lr scale made no difference in the engine";
  }
}

// The gradient is the mean over world x accumulation: two ranks (different
// data) against the reference summing them.
TEST(DrivenEngineReference, World2Stage0And3MatchPlainLoops) {
  for (int stage : {0, 3}) {
    DrivenRun run;
    run.world = 2;
    run.opt.stage = stage;
    if (stage == 3) run.opt.offload_optimizer = run.opt.offload_param = OffloadDevice::kCpu;
    run.label = fmt::format("world 2 stage {} reference", stage);
    expect_matches_reference(drive(run), reference(run), run.label);
  }
}

// ---------------------------------------------------------------- 2. parity over stages and placements

struct MlpPlacement {
  int stage = 0;
  OffloadDevice optimizer = OffloadDevice::kNone, param = OffloadDevice::kNone;
  bool overlap = true;
  int64_t sub_group = 1'000'000'000;
  int64_t max_live = 1'000'000'000, reuse = 1'000'000'000, persistence = 0;
  std::string name() const {
    std::string s = fmt::format("stage{}_opt_{}_param_{}_overlap_{}", stage, offload_device_name(optimizer),
                                offload_device_name(param), overlap ? "on" : "off");
    if (sub_group != 1'000'000'000) s += fmt::format("_subgroup{}", sub_group);
    if (max_live != 1'000'000'000) s += fmt::format("_live{}", max_live);
    if (reuse != 1'000'000'000) s += fmt::format("_reuse{}", reuse);
    if (persistence != 0) s += fmt::format("_persist{}", persistence);
    return s;
  }
};

std::vector<MlpPlacement> placements() {
  using D = OffloadDevice;
  std::vector<MlpPlacement> v;
  for (int stage = 0; stage <= 2; ++stage)
    for (D o : {D::kNone, D::kCpu, D::kNvme})
      for (bool overlap : {true, false}) {
        if (stage == 0 && o == D::kNone && !overlap) continue;  // the baseline itself
        v.push_back({stage, o, D::kNone, overlap});
      }
  const std::pair<D, D> stage3[] = {{D::kNone, D::kNone}, {D::kCpu, D::kNone}, {D::kCpu, D::kCpu},  {D::kCpu, D::kNvme},
                                    {D::kNvme, D::kNone}, {D::kNvme, D::kCpu}, {D::kNvme, D::kNvme}};
  for (auto [o, p] : stage3)
    for (bool overlap : {true, false}) v.push_back({3, o, p, overlap});
  // Several sub-groups per layer (sub_group_size rounds to world x 2048),
  // a live cap of about one layer and no reuse, every layer persistent.
  v.push_back({3, D::kCpu, D::kCpu, true, 4096, 10'000, 0, 0});
  v.push_back({3, D::kNvme, D::kNvme, false, 4096, 10'000, 0, 0});
  v.push_back({3, D::kNone, D::kNone, true, 1'000'000'000, 1'000'000'000, 1'000'000'000, 100'000});
  v.push_back({2, D::kCpu, D::kNone, false, 4096});
  v.push_back({1, D::kNvme, D::kNone, true, 4096});
  return v;
}

void apply(EngineOptions& o, const MlpPlacement& p) {
  o.stage = p.stage;
  o.offload_optimizer = p.optimizer;
  o.offload_param = p.param;
  o.overlap_optimizer = p.overlap;
  o.sub_group_size = p.sub_group;
  o.max_live_parameters = p.max_live;
  o.max_reuse_distance = p.reuse;
  o.persistence_threshold = p.persistence;
  if (p.optimizer == OffloadDevice::kNvme) {
    o.nvme.path = ::testing::TempDir();
    o.nvme.buffer_count = 3;
    o.nvme.pipeline_read = o.nvme.pipeline_write = true;
  }
  if (p.param == OffloadDevice::kNvme) {
    o.nvme_param.path = ::testing::TempDir();
    o.nvme_param.buffer_count = 2;
    o.nvme_param.max_in_cpu = 0;
  }
}

DrivenRun parity_run(DType dtype) {
  DrivenRun run;
  run.world = 2;
  run.steps = 6;
  run.eval_every = 3;
  run.spec.dtype = dtype;
  run.opt.grad_dtype = dtype;
  return run;
}

// Stage 0, world 2, overlap off: what every placement must reproduce.
const DrivenOutcome& parity_baseline(DType dtype) {
  static std::map<DType, DrivenOutcome> cache;
  auto it = cache.find(dtype);
  if (it == cache.end()) {
    DrivenRun run = parity_run(dtype);
    run.opt.overlap_optimizer = false;
    run.label = fmt::format("parity baseline {}", dtype_name(dtype));
    it = cache.emplace(dtype, drive(run)).first;
  }
  return it->second;
}

class DrivenParity : public ::testing::TestWithParam<std::tuple<DType, MlpPlacement>> {};

TEST_P(DrivenParity, BitIdenticalToStage0OverlapOff) {
  const auto& [dtype, placement] = GetParam();
  const DrivenOutcome& base = parity_baseline(dtype);
  ASSERT_TRUE(base.status.ok()) << "baseline: " << base.status.to_string();
  ASSERT_EQ(base.losses.size(), 6u);
  DrivenRun run = parity_run(dtype);
  apply(run.opt, placement);
  run.label = fmt::format("world 2 {} {}", dtype_name(dtype), placement.name());
  expect_bit_identical(base, drive(run), run.label);
}

INSTANTIATE_TEST_SUITE_P(World2, DrivenParity,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::ValuesIn(placements())),
                         [](const auto& info) {
                           return fmt::format("{}_{}", dtype_name(std::get<0>(info.param)),
                                              std::get<1>(info.param).name());
                         });

// ---------------------------------------------------------------- 3. driver misuse

// `st` is refused with `code` and its message names `call`.
void expect_refused(const Status& st, StatusCode code, const std::string& call, const std::string& what) {
  EXPECT_FALSE(st.ok()) << what << ": accepted";
  if (st.ok()) return;
  EXPECT_EQ(st.code(), code) << what << ": " << st.to_string();
  EXPECT_NE(st.message().find(call), std::string::npos)
      << what << ": the message does not name " << call << ": " << st.to_string();
}

// Every out-of-order call is refused naming the call; none changes the
// engine: the same steps afterwards give the losses of a run without them.
TEST(DrivenEngineMisuse, OutOfOrderCallsFailNamingTheCallAndTheEngineGoesOn) {
  Watchdog dog("misuse", std::chrono::seconds(120));
  EngineOptions opt = base_options();
  // Stage 3 with offloaded optimizer and parameters: the most machinery.
  opt.stage = 3;
  opt.offload_optimizer = opt.offload_param = OffloadDevice::kCpu;
  constexpr int kSteps = 4;

  // The run without misuse.
  std::vector<double> clean;
  {
    auto comms = comm::create_local_group(1).value();
    auto d = DrivenRank::create(opt, {}, *comms[0]).value();
    ASSERT_TRUE(d->put_all().ok());
    for (int64_t s = 1; s <= kSteps; ++s) {
      Result<StepMetrics> m = d->step(s);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      clean.push_back(m->loss);
    }
  }

  auto comms = comm::create_local_group(1).value();
  Result<std::unique_ptr<DrivenRank>> created = DrivenRank::create(opt, {}, *comms[0]);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  DrivenRank& d = **created;
  Engine& e = d.engine();
  const auto ok = [](const Status& st, const std::string& what) {
    ASSERT_TRUE(st.ok()) << what << ": " << st.to_string();
  };
  const auto no_runner = "ModelRunner";

  // An engine without a runner: step() and evaluate() say so.
  {
    Result<StepMetrics> r = e.step();
    expect_refused(r.status(), StatusCode::kFailedPrecondition, "step()", "step() without a runner");
    if (!r.ok()) {
      EXPECT_NE(r.status().message().find(no_runner), std::string::npos) << r.status().to_string();
    }
    Result<double> v = e.evaluate();
    expect_refused(v.status(), StatusCode::kFailedPrecondition, "evaluate()", "evaluate() without a runner");
  }
  // put_initial_layer: a layer out of range, bytes of the wrong size.
  {
    const std::vector<std::byte> bytes(16);
    expect_refused(e.put_initial_layer(mlp::kLayerCount, bytes), StatusCode::kInvalidArgument, "put_initial_layer",
                   "put_initial_layer of a layer out of range");
    expect_refused(e.put_initial_layer(0, bytes), StatusCode::kInvalidArgument, "put_initial_layer",
                   "put_initial_layer with 16 bytes for layer 0");
  }
  ok(d.put_all(), "put_initial_layer of every layer");

  // Outside a step.
  expect_refused(e.begin_micro_batch(false), StatusCode::kFailedPrecondition, "begin_micro_batch()",
                 "begin_micro_batch before begin_step");
  expect_refused(e.end_micro_batch(1.0, kBatch), StatusCode::kFailedPrecondition, "end_micro_batch()",
                 "end_micro_batch before begin_step");
  expect_refused(e.finish_step().status(), StatusCode::kFailedPrecondition, "finish_step()",
                 "finish_step before begin_step");
  expect_refused(e.acquire(0, Pass::kForward).status(), StatusCode::kFailedPrecondition, "acquire",
                 "acquire(kForward) outside a step");
  expect_refused(e.acquire(0, Pass::kBackward).status(), StatusCode::kFailedPrecondition, "acquire",
                 "acquire(kBackward) outside a step");
  expect_refused(e.finish_evaluation(0.0, 1).status(), StatusCode::kFailedPrecondition, "finish_evaluation()",
                 "finish_evaluation without begin_evaluation");
  expect_refused(e.release(0, Pass::kForward, Completion()), StatusCode::kFailedPrecondition, "release",
                 "release of a layer not held");

  std::vector<double> losses;
  // Step 1, with mistakes between and inside its micro-batches.
  {
    ok(e.begin_step(), "begin_step");
    expect_refused(e.begin_step(), StatusCode::kFailedPrecondition, "begin_step()", "begin_step inside a step");
    expect_refused(e.acquire(0, Pass::kForward).status(), StatusCode::kFailedPrecondition, "acquire",
                   "acquire(kForward) between micro-batches");
    expect_refused(e.begin_evaluation(), StatusCode::kFailedPrecondition, "begin_evaluation()",
                   "begin_evaluation inside a step");
    expect_refused(e.begin_micro_batch(true), StatusCode::kInvalidArgument, "begin_micro_batch(last=true)",
                   "begin_micro_batch(last=true) on the first of 2 micro-batches");
    ok(e.begin_micro_batch(false), "begin_micro_batch(false)");
    expect_refused(e.begin_micro_batch(false), StatusCode::kFailedPrecondition, "begin_micro_batch()",
                   "begin_micro_batch inside a micro-batch");
    expect_refused(e.finish_step().status(), StatusCode::kFailedPrecondition, "finish_step()",
                   "finish_step inside a micro-batch");
    Result<double> loss = d.passes(1, 0);
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    ok(e.end_micro_batch(*loss, kBatch), "end_micro_batch");
    expect_refused(e.end_micro_batch(*loss, kBatch), StatusCode::kFailedPrecondition, "end_micro_batch()",
                   "end_micro_batch twice");
    expect_refused(e.finish_step().status(), StatusCode::kFailedPrecondition, "finish_step()",
                   "finish_step after 1 of 2 micro-batches");
    ok(d.micro_batch(1, 1), "the last micro-batch");
    expect_refused(e.begin_micro_batch(false), StatusCode::kFailedPrecondition, "begin_micro_batch",
                   "a third micro-batch");
    Result<StepOutcome> out = e.finish_step();
    ASSERT_TRUE(out.ok()) << out.status().to_string();
    ASSERT_TRUE(out->applied()) << out->reason.to_string();
    losses.push_back(out->metrics.loss);
    expect_refused(e.finish_step().status(), StatusCode::kFailedPrecondition, "finish_step()", "finish_step twice");
  }
  // An evaluation with mistakes: a training acquire inside it.
  {
    ok(e.begin_evaluation(), "begin_evaluation");
    expect_refused(e.acquire(0, Pass::kBackward).status(), StatusCode::kFailedPrecondition, "acquire",
                   "acquire(kBackward) inside an evaluation");
    expect_refused(e.begin_step(), StatusCode::kFailedPrecondition, "begin_step()", "begin_step inside an evaluation");
    Result<double> v = d.evaluate_batches();
    ASSERT_TRUE(v.ok()) << v.status().to_string();
  }
  // Correct steps go on, with the clean run's losses.
  for (int64_t s = 2; s <= kSteps; ++s) {
    Result<StepMetrics> m = d.step(s);
    ASSERT_TRUE(m.ok()) << "step " << s << " after the misuse: " << m.status().to_string();
    losses.push_back(m->loss);
  }
  ok(e.stopped(), "the engine after the misuse");
  ASSERT_EQ(losses.size(), clean.size());
  for (size_t i = 0; i < clean.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint64_t>(losses[i]), std::bit_cast<uint64_t>(clean[i]))
        << "step " << i + 1 << ": " << fmt::format("{:.17g}", losses[i]) << " after the refused calls vs "
        << fmt::format("{:.17g}", clean[i]) << " without them";
}

// A layer without initial values: begin_step() refuses it, naming it, and
// the engine trains once it has them (the losses of a run that put every
// layer first).
TEST(DrivenEngineMisuse, BeginStepBeforeEveryLayerIsPutNamesTheLayerAndTheEngineGoesOn) {
  Watchdog dog("missing layer", std::chrono::seconds(60));
  EngineOptions opt = base_options();
  opt.stage = 3;
  opt.offload_optimizer = opt.offload_param = OffloadDevice::kCpu;
  double clean = 0;
  {
    auto comms = comm::create_local_group(1).value();
    auto d = DrivenRank::create(opt, {}, *comms[0]).value();
    ASSERT_TRUE(d->put_all().ok());
    Result<StepMetrics> m = d->step(1);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    clean = m->loss;
  }
  auto comms = comm::create_local_group(1).value();
  Result<std::unique_ptr<DrivenRank>> created = DrivenRank::create(opt, {}, *comms[0]);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  DrivenRank& d = **created;
  for (size_t li = 0; li + 1 < mlp::kLayerCount; ++li) ASSERT_TRUE(d.put_layer(li).ok());
  const Status refused = d.engine().begin_step();
  expect_refused(refused, StatusCode::kFailedPrecondition, "head", "begin_step() before layer 3 was put");
  if (!refused.ok()) {
    EXPECT_NE(refused.message().find("put_initial_layer"), std::string::npos) << refused.to_string();
  }
  EXPECT_TRUE(d.engine().stopped().ok()) << "a caller's mistake stopped the engine: "
                                         << d.engine().stopped().to_string();
  ASSERT_TRUE(d.put_layer(mlp::kLayerCount - 1).ok());
  Result<StepMetrics> m = d.step(1);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(std::bit_cast<uint64_t>(m->loss), std::bit_cast<uint64_t>(clean))
      << fmt::format("{:.17g} vs {:.17g}", m->loss, clean);
}

// An evaluation of no batch anywhere has no mean: refused, and the engine
// goes on (a caller's mistake, not a failure of the engine's work).
TEST(DrivenEngineMisuse, EvaluationOfNoBatchIsRefusedAndTheEngineGoesOn) {
  Watchdog dog("empty evaluation", std::chrono::seconds(60));
  auto comms = comm::create_local_group(1).value();
  Result<std::unique_ptr<DrivenRank>> created = DrivenRank::create(base_options(), {}, *comms[0]);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  DrivenRank& d = **created;
  ASSERT_TRUE(d.put_all().ok());
  ASSERT_TRUE(d.engine().begin_evaluation().ok());
  Result<double> v = d.engine().finish_evaluation(0.0, 0);
  EXPECT_FALSE(v.ok()) << "an evaluation of no batch returned " << *v;
  if (!v.ok()) {
    EXPECT_NE(v.status().message().find("finish_evaluation"), std::string::npos) << v.status().to_string();
  }
  EXPECT_TRUE(d.engine().stopped().ok()) << "a caller's mistake stopped the engine: "
                                         << d.engine().stopped().to_string();
  Result<StepMetrics> m = d.step(1);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
}

// ---------------------------------------------------------------- 4. the acquire order is a hint

struct OrderCase {
  std::string name;
  std::function<MlpOrder(int rank, int64_t step, int micro)> order;
  bool ranks_differ = false;  // the ranks visit the layers in different orders
};

std::vector<OrderCase> order_cases() {
  return {
      {"swap_forward_in_step_3",
       [](int, int64_t s, int) { return s == 3 ? MlpOrder::kSwapForward : MlpOrder::kNatural; }},
      {"swap_forward_from_the_start", [](int, int64_t, int) { return MlpOrder::kSwapForward; }},
      {"swap_backward_in_the_last_micro_batch_of_step_3",
       [](int, int64_t s, int k) { return s == 3 && k == 1 ? MlpOrder::kSwapBackward : MlpOrder::kNatural; }},
      {"recompute_in_backward_on_steps_3_and_5",
       [](int, int64_t s, int) { return s == 3 || s == 5 ? MlpOrder::kRecompute : MlpOrder::kNatural; }},
      {"rank_1_swaps_backward_every_step",
       [](int r, int64_t, int) { return r == 1 ? MlpOrder::kSwapBackward : MlpOrder::kNatural; }, true},
      {"rank_0_recomputes_rank_1_swaps_forward",
       [](int r, int64_t, int) { return r == 0 ? MlpOrder::kRecompute : MlpOrder::kSwapForward; }, true},
  };
}

class DrivenAcquireOrder : public ::testing::TestWithParam<MlpPlacement> {};

// Every order computes the same numbers (Note [The MLP's acquire sequence]),
// so every run gives the natural order's losses bit for bit; in particular
// a step that departs from the recorded order gives the loss of a fresh run
// with that order from the start. Below stage 3, ranks may also visit the
// layers in different orders (mixture-of-experts style).
TEST_P(DrivenAcquireOrder, OtherOrdersSucceedWithTheSameLosses) {
  const MlpPlacement& p = GetParam();
  DrivenRun base;
  base.world = 2;
  base.steps = 6;
  base.eval_every = 3;
  apply(base.opt, p);
  base.label = fmt::format("{} natural order", p.name());
  const DrivenOutcome natural = drive(base);
  ASSERT_TRUE(natural.status.ok()) << base.label << ": " << natural.status.to_string();
  for (const OrderCase& c : order_cases()) {
    // Stage 3 gathers parameters with collectives in each rank's acquire
    // order: ranks that visit layers in different orders issue different
    // collectives (DeepSpeed's ZeRO-3 has the same rule). Below stage 3 the
    // only collectives are the reductions, issued in canonical order.
    if (c.ranks_differ && p.stage == 3) continue;
    DrivenRun run = base;
    run.order = c.order;
    run.label = fmt::format("{} {}", p.name(), c.name);
    expect_bit_identical(natural, drive(run), run.label);
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, DrivenAcquireOrder,
                         ::testing::Values(MlpPlacement{0, OffloadDevice::kNone, OffloadDevice::kNone, true},
                                           MlpPlacement{2, OffloadDevice::kCpu, OffloadDevice::kNone, true},
                                           MlpPlacement{3, OffloadDevice::kCpu, OffloadDevice::kCpu, true},
                                           MlpPlacement{3, OffloadDevice::kNvme, OffloadDevice::kNvme, false, 4096,
                                                        10'000, 0, 0}),
                         [](const auto& info) { return info.param.name(); });

// ---------------------------------------------------------------- 4b. abandoned steps

class DrivenAbandon : public ::testing::TestWithParam<MlpPlacement> {};

// A step given up anywhere between begin_step() and finish_step() and run
// again leaves no trace: losses, evaluations and master weights are bit-
// identical to a run that never began it (with overlap the previous
// step's updates are still pending when it is abandoned). Steps 2 and 4 are
// abandoned at different points, so both a recorded and a followed acquire
// sequence are cut.
TEST_P(DrivenAbandon, ARepeatedStepGivesTheLossesOfARunThatNeverBeganIt) {
  const MlpPlacement& p = GetParam();
  DrivenRun base;
  base.world = 2;
  base.steps = 5;
  base.eval_every = 5;
  apply(base.opt, p);
  base.label = fmt::format("{} uninterrupted", p.name());
  const DrivenOutcome clean = drive(base);
  ASSERT_TRUE(clean.status.ok()) << base.label << ": " << clean.status.to_string();
  const AbandonAt points[] = {AbandonAt::kAfterBeginStep, AbandonAt::kMidForward, AbandonAt::kAfterLastPasses,
                              AbandonAt::kAfterLastMicroBatch};
  for (AbandonAt at : points) {
    DrivenRun run = base;
    run.abandon = [at](int64_t s) -> std::optional<AbandonAt> {
      if (s == 1 || s == 4) return at;  // the first (recording) step and a followed one
      return std::nullopt;
    };
    run.label = fmt::format("{} abandoned {}", p.name(), abandon_at_name(at));
    expect_bit_identical(clean, drive(run), run.label);
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, DrivenAbandon,
                         ::testing::Values(MlpPlacement{0, OffloadDevice::kNone, OffloadDevice::kNone, true},
                                           MlpPlacement{1, OffloadDevice::kCpu, OffloadDevice::kNone, true},
                                           MlpPlacement{2, OffloadDevice::kNvme, OffloadDevice::kNone, true},
                                           MlpPlacement{3, OffloadDevice::kCpu, OffloadDevice::kCpu, true},
                                           MlpPlacement{3, OffloadDevice::kNvme, OffloadDevice::kNvme, false, 4096,
                                                        10'000, 0, 0}),
                         [](const auto& info) { return info.param.name(); });

TEST(DrivenEngineMisuse, AbandonStepOutsideAStepIsRefusedAndTheEngineGoesOn) {
  auto comms = comm::create_local_group(1).value();
  Result<std::unique_ptr<DrivenRank>> made = DrivenRank::create(base_options(), MlpSpecOptions{}, *comms[0]);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  DrivenRank& d = **made;
  ASSERT_TRUE(d.put_all().ok());
  expect_refused(d.engine().abandon_step(), StatusCode::kFailedPrecondition, "abandon_step()", "before any step");
  Result<StepMetrics> m = d.step(1);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  expect_refused(d.engine().abandon_step(), StatusCode::kFailedPrecondition, "abandon_step()", "after a step");
  EXPECT_TRUE(d.engine().stopped().ok()) << d.engine().stopped().to_string();
  EXPECT_TRUE(d.step(2).ok());
}

// phase() and layer_holds() are the engine's own state (Note [Driving the
// engine]): each bracket call moves the phase, a refused call (order or
// argument) changes neither, every acquire of a pass counts until its
// release, abandon_step() releases them all, and a finish_evaluation() or
// finish_step() that fails in its work has ended its bracket.
TEST(DrivenEngineState, PhaseAndHoldsAreAnsweredByTheEngine) {
  Watchdog dog("phase and holds", std::chrono::seconds(60));
  EngineOptions opt = base_options();
  opt.stage = 3;
  opt.offload_optimizer = opt.offload_param = OffloadDevice::kCpu;
  ASSERT_EQ(opt.grad_accum, 2);
  auto comms = comm::create_local_group(1).value();
  Result<std::unique_ptr<DrivenRank>> made = DrivenRank::create(opt, MlpSpecOptions{}, *comms[0]);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  DrivenRank& d = **made;
  Engine& e = d.engine();
  ASSERT_TRUE(d.put_all().ok());
  using Phase = Engine::Phase;
  const auto holds = [&](size_t li) {
    Result<int> h = e.layer_holds(li);
    EXPECT_TRUE(h.ok()) << h.status().to_string();
    return h.ok() ? *h : -1;
  };
  expect_refused(e.layer_holds(mlp::kLayerCount).status(), StatusCode::kInvalidArgument, "layer_holds",
                 "layer_holds of a layer out of range");

  EXPECT_EQ(e.phase(), Phase::kIdle);
  expect_refused(e.begin_micro_batch(false), StatusCode::kFailedPrecondition, "begin_micro_batch()", "outside a step");
  EXPECT_EQ(e.phase(), Phase::kIdle);
  ASSERT_TRUE(e.begin_step().ok());
  EXPECT_EQ(e.phase(), Phase::kStep);
  expect_refused(e.begin_step(), StatusCode::kFailedPrecondition, "begin_step()", "inside a step");
  expect_refused(e.begin_micro_batch(true), StatusCode::kInvalidArgument, "begin_micro_batch", "last on the first");
  EXPECT_EQ(e.phase(), Phase::kStep);
  ASSERT_TRUE(e.begin_micro_batch(false).ok());
  EXPECT_EQ(e.phase(), Phase::kMicroBatch);

  // Two passes hold layer 0 (a tied weight's two uses, a recompute): held until both release.
  ASSERT_TRUE(e.acquire(0, Pass::kForward).ok());
  ASSERT_TRUE(e.acquire(0, Pass::kForward).ok());
  EXPECT_EQ(holds(0), 2);
  EXPECT_EQ(holds(1), 0);
  ASSERT_TRUE(e.release(0, Pass::kForward, Completion()).ok());
  EXPECT_EQ(holds(0), 1);
  ASSERT_TRUE(e.release(0, Pass::kForward, Completion()).ok());
  EXPECT_EQ(holds(0), 0);
  expect_refused(e.release(0, Pass::kForward, Completion()), StatusCode::kFailedPrecondition, "release",
                 "a third release");
  EXPECT_EQ(holds(0), 0);
  expect_refused(e.end_micro_batch(1.0, -1), StatusCode::kInvalidArgument, "end_micro_batch()", "negative tokens");
  EXPECT_EQ(e.phase(), Phase::kMicroBatch);
  ASSERT_TRUE(e.end_micro_batch(1.0, kBatch).ok());
  EXPECT_EQ(e.phase(), Phase::kStep);

  // The step given up with layers held: every hold is released.
  ASSERT_TRUE(e.begin_micro_batch(true).ok());
  ASSERT_TRUE(e.acquire(0, Pass::kForward).ok());
  ASSERT_TRUE(e.acquire(1, Pass::kForward).ok());
  ASSERT_TRUE(e.acquire(1, Pass::kBackward).ok());  // a forward's hold and a backward's on one layer
  EXPECT_EQ(holds(0), 1);
  EXPECT_EQ(holds(1), 2);
  ASSERT_TRUE(e.abandon_step().ok());
  EXPECT_EQ(e.phase(), Phase::kIdle);
  for (size_t li = 0; li < mlp::kLayerCount; ++li) EXPECT_EQ(holds(li), 0) << "layer " << li;

  // An evaluation whose finish fails in its work (no rank evaluated a batch) is over.
  ASSERT_TRUE(e.begin_evaluation().ok());
  EXPECT_EQ(e.phase(), Phase::kEvaluation);
  ASSERT_TRUE(e.acquire(0, Pass::kEval).ok());
  EXPECT_EQ(holds(0), 1);
  ASSERT_TRUE(e.release(0, Pass::kEval, Completion()).ok());
  expect_refused(e.finish_evaluation(0.0, 0).status(), StatusCode::kInvalidArgument, "finish_evaluation()",
                 "no batch on any rank");
  EXPECT_EQ(e.phase(), Phase::kIdle);
  EXPECT_TRUE(e.stopped().ok()) << e.stopped().to_string();

  Result<StepMetrics> m = d.step(1);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(e.phase(), Phase::kIdle);
  for (size_t li = 0; li < mlp::kLayerCount; ++li) EXPECT_EQ(holds(li), 0) << "layer " << li;

  // A finish_step() that fails in its work (a NaN gradient in fp32 stops the
  // engine) has ended the step; the stopped engine keeps that phase and
  // refuses the next begin_step().
  ASSERT_TRUE(e.begin_step().ok());
  ASSERT_TRUE(d.micro_batch(2, 0).ok());
  ASSERT_TRUE(e.begin_micro_batch(true).ok());
  Result<LayerMemory> lent = e.acquire(0, Pass::kBackward);
  ASSERT_TRUE(lent.ok()) << lent.status().to_string();
  ASSERT_EQ(lent->grad_dtype, DType::kF32);
  ASSERT_TRUE(lent->ready.wait().ok());
  static_cast<float*>(lent->grads)[0] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(e.release(0, Pass::kBackward, Completion()).ok());
  ASSERT_TRUE(e.end_micro_batch(1.0, kBatch).ok());
  Result<StepOutcome> failed = e.finish_step();
  ASSERT_FALSE(failed.ok()) << "a NaN gradient was stepped";
  EXPECT_EQ(failed.status().code(), StatusCode::kDataLoss) << failed.status().to_string();
  EXPECT_FALSE(e.stopped().ok());
  EXPECT_EQ(e.phase(), Phase::kIdle);
  EXPECT_EQ(e.begin_step().code(), StatusCode::kDataLoss);
  EXPECT_EQ(e.phase(), Phase::kIdle);
}

// ---------------------------------------------------------------- 4c. the caller's lr

// set_step_lr(lr) steps with that lr: the config's own lr through it gives
// the same bits as the config, lr 0 leaves every master weight at its
// initial value (AdamW: no step, no decay), a schedule of the caller's
// differs from the config's; bad values are refused and change nothing.
TEST(DrivenEngineStepLr, TheCallersLrIsTheStepsLr) {
  DrivenRun base;
  base.world = 2;
  base.steps = 4;
  base.eval_every = 0;
  base.opt.stage = 3;
  base.opt.offload_optimizer = OffloadDevice::kCpu;
  base.label = "config lr";
  const DrivenOutcome config_lr = drive(base);
  ASSERT_TRUE(config_lr.status.ok()) << config_lr.status.to_string();

  DrivenRun same = base;
  same.step_lr = [&](int64_t) { return base.opt.hyper.lr; };
  same.label = "the config's lr set by the caller";
  expect_bit_identical(config_lr, drive(same), same.label);

  DrivenRun frozen = base;
  frozen.step_lr = [](int64_t) { return 0.0; };
  frozen.label = "lr 0";
  const DrivenOutcome none = drive(frozen);
  ASSERT_TRUE(none.status.ok()) << none.status.to_string();
  const std::vector<std::vector<float>> init = mlp::initial_values(kInitSeed);
  for (size_t li = 0; li < mlp::kLayerCount; ++li) {
    if (li == mlp::kFrozen) continue;
    ASSERT_EQ(none.masters[li].size(), init[li].size()) << "layer " << li;
    EXPECT_EQ(std::memcmp(none.masters[li].data(), init[li].data(), init[li].size() * sizeof(float)), 0)
        << "layer " << li << " moved with lr 0";
  }

  DrivenRun decaying = base;
  decaying.step_lr = [&](int64_t s) { return base.opt.hyper.lr / static_cast<double>(s); };
  decaying.label = "lr / step";
  const DrivenOutcome other = drive(decaying);
  ASSERT_TRUE(other.status.ok()) << other.status.to_string();
  EXPECT_EQ(other.losses[0], config_lr.losses[0]);  // the first step's loss is before any update
  EXPECT_NE(other.losses.back(), config_lr.losses.back());

  auto comms = comm::create_local_group(1).value();
  auto d = DrivenRank::create(base_options(), {}, *comms[0]).value();
  for (double bad : {std::nan(""), -1e-3, 1e4, std::numeric_limits<double>::infinity()})
    expect_refused(d->engine().set_step_lr(bad), StatusCode::kInvalidArgument, "set_step_lr", fmt::format("lr {}", bad));
  ASSERT_TRUE(d->put_all().ok());
  Result<StepMetrics> m = d->step(1);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->lr, base_options().hyper.lr);  // the refusals changed nothing
}

// ---------------------------------------------------------------- 5. SpecModel::create

// `layers` is refused (InvalidArgument) and the message holds each of `names`.
void expect_spec_refused(std::vector<LayerDescription> layers, const std::vector<std::string>& names,
                         const std::string& what) {
  Result<SpecModel> m = SpecModel::create(std::move(layers));
  ASSERT_FALSE(m.ok()) << what << ": accepted";
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << what << ": " << m.status().to_string();
  for (const std::string& n : names)
    EXPECT_NE(m.status().message().find(n), std::string::npos)
        << what << ": the message does not name '" << n << "': " << m.status().to_string();
}

TEST(SpecModelCreate, RefusesBadDescriptionsNamingTheLayerAndTensor) {
  using D = DType;
  using mlp::tensor;
  const TensorDescription w = tensor("blk.weight", {4, 4}, D::kF32);
  expect_spec_refused({}, {"layer"}, "no layers");
  expect_spec_refused({{"", {w}}}, {"layer 0"}, "an empty layer name");
  expect_spec_refused({{"ok", {w}}, {"blk", {}}}, {"layer 1", "blk"}, "a layer without tensors");
  expect_spec_refused({{"blk", {w, tensor("", {4}, D::kF32)}}}, {"blk"}, "an empty tensor name");
  expect_spec_refused({{"blk", {tensor("blk.weight", {4, 0}, D::kF32)}}}, {"blk", "blk.weight", "0"}, "a zero extent");
  expect_spec_refused({{"blk", {tensor("blk.weight", {-3}, D::kF32)}}}, {"blk", "blk.weight"}, "a negative extent");
  expect_spec_refused({{"blk", {w, tensor("blk.bias", {4}, D::kBF16)}}}, {"blk", "blk.bias", "bf16", "fp32"},
                      "mixed dtypes in a layer");
  expect_spec_refused({{"blk", {tensor("blk.weight", {4}, D::kF64)}}}, {"blk", "blk.weight", "fp64"}, "an fp64 tensor");
  expect_spec_refused({{"blk", {w, tensor("blk.bias", {4}, D::kF32, /*trainable=*/false)}}},
                      {"blk", "blk.bias", "frozen"}, "mixed trainable and frozen tensors");
  expect_spec_refused({{"blk", {w, tensor("blk.bias", {4}, D::kF32, true, -0.1)}}}, {"blk", "blk.bias", "weight_decay"},
                      "a negative weight decay");
  expect_spec_refused({{"blk", {w, tensor("blk.bias", {4}, D::kF32, true, std::numeric_limits<double>::infinity())}}},
                      {"blk", "blk.bias", "weight_decay"}, "an infinite weight decay");
  expect_spec_refused(
      {{"blk", {w, tensor("blk.bias", {4}, D::kF32, true, std::nullopt, std::numeric_limits<double>::quiet_NaN())}}},
      {"blk", "blk.bias", "lr_scale"}, "a NaN lr scale");
  expect_spec_refused({{"blk", {w, tensor("blk.bias", {4}, D::kF32, true, std::nullopt, -1.0)}}},
                      {"blk", "blk.bias", "lr_scale"}, "a negative lr scale");
  // The second layer's problem names the second layer.
  expect_spec_refused({{"first", {w}}, {"second", {tensor("second.w", {2, 0}, D::kF32)}}},
                      {"layer 1", "second", "second.w"}, "a problem in the second layer");
}

TEST(SpecModelCreate, LaysTensorsOutBackToBackWithTheirHyperParameters) {
  Result<SpecModel> m = SpecModel::create(mlp::layer_descriptions({.dtype = DType::kBF16}));
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const auto layers = m->layers();
  ASSERT_EQ(layers.size(), mlp::kLayerCount);
  EXPECT_FALSE(m->provides_initial_values());
  for (size_t li = 0; li < mlp::kLayerCount; ++li) {
    EXPECT_EQ(layers[li].param_count, mlp::layer_elements(li)) << li;
    EXPECT_EQ(layers[li].param_bytes, 2 * mlp::layer_elements(li)) << li;
    EXPECT_EQ(m->frozen(li), li == mlp::kFrozen) << li;
    EXPECT_EQ(layer_frozen(layers[li]), li == mlp::kFrozen) << li;
  }
  const LayerSpec& embed = layers[mlp::kEmbedIn];
  ASSERT_EQ(embed.params.size(), 2u);
  EXPECT_EQ(embed.params[1].name, "embed_in.bias");
  EXPECT_EQ(embed.params[1].offset_elements, mlp::kW0);
  EXPECT_EQ(embed.params[1].offset_bytes, 2 * mlp::kW0);
  EXPECT_FALSE(embed.params[0].weight_decay.has_value());
  ASSERT_TRUE(embed.params[1].weight_decay.has_value());
  EXPECT_EQ(*embed.params[1].weight_decay, 0.0);
  EXPECT_EQ(layers[mlp::kHead].params[0].lr_scale, mlp::kHeadLrScale);
  EXPECT_EQ(layers[mlp::kCond].params[0].lr_scale, 1.0);
}

}  // namespace
}  // namespace strata::offload
