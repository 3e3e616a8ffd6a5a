// The scalar reference against textbook values computed here in double,
// and the CpuOptimizer contract: tiles and callbacks, threads, fused
// scaling, per-call hyper-parameters, beta^t without drift, input errors.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <set>

#include "strata/cpu_adam/optimizer.h"
#include "test_state.h"

namespace strata::cpu_adam::testing {
namespace {

TEST(Reference, AdamWMatchesTextbookOverSteps) {
  // Independent AdamW over 50 steps, one element at a time, computed in
  // double and stored in float after each step (as the state is).
  Mix mix{OptimizerKind::kAdamW};
  CpuOptimizer opt = make_optimizer(mix.kind, KernelPath::kScalar);
  const size_t n = 64;
  TestState s(mix, n);
  s.fill(1);
  std::vector<double> p(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = s.params()[i];
    m[i] = static_cast<float*>(s.m())[i];
    v[i] = static_cast<float*>(s.v())[i];
  }
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  for (int t = 1; t <= 50; ++t) {
    s.fill_grads(1000 + t, 0.5f);
    StepArgs a;
    a.step = t;
    a.hyper = {.lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd};
    ASSERT_TRUE(opt.step(a, s.spans()).ok());
    for (size_t i = 0; i < n; ++i) {
      const double g = static_cast<float*>(s.grads())[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
      // The decay factor is a float in every fp32 implementation (torch's
      // mul_ too); in double its rounding would add a 3e-6 systematic drift.
      p[i] = p[i] * static_cast<float>(1 - lr * wd) - lr * mhat / (std::sqrt(vhat) + eps);
      p[i] = static_cast<float>(p[i]);
      m[i] = static_cast<float>(m[i]);
      v[i] = static_cast<float>(v[i]);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(s.params()[i], p[i], 1e-6 * std::fabs(p[i]) + 1e-7) << i;
    EXPECT_NEAR(static_cast<float*>(s.m())[i], m[i], 1e-5 * std::fabs(m[i]) + 1e-8) << i;
    EXPECT_NEAR(static_cast<float*>(s.v())[i], v[i], 1e-5 * std::fabs(v[i]) + 1e-10) << i;
  }
}

TEST(Reference, FirstStepsByHand) {
  // Adam first step with bias correction and zero state: p - lr * g / (|g| + eps).
  // Adagrad first step: p - lr * g / (|g| + eps). Lion: p - lr * sign(g).
  // Adam without bias correction: m = 0.1 g, v = 0.001 g^2: p - lr * 0.1 g / (0.0316 |g| + eps).
  const float g = 0.25f, p0 = 1.0f;
  auto run = [&](OptimizerKind kind, bool bias_correction) {
    Mix mix{kind};
    CpuOptimizer opt = make_optimizer(kind, KernelPath::kAuto);
    TestState s(mix, 1);
    s.params()[0] = p0;
    s.set_grad(0, g);
    StepArgs a;
    a.hyper.lr = 0.01;
    a.hyper.bias_correction = bias_correction;
    EXPECT_TRUE(opt.step(a, s.spans()).ok());
    return s.params()[0];
  };
  EXPECT_NEAR(run(OptimizerKind::kAdam, true), p0 - 0.01 * g / (g + 1e-8), 1e-7);
  EXPECT_NEAR(run(OptimizerKind::kAdagrad, true), p0 - 0.01 * g / (g + 1e-8), 1e-7);
  EXPECT_NEAR(run(OptimizerKind::kLion, true), p0 - 0.01, 1e-7);
  EXPECT_NEAR(run(OptimizerKind::kAdamW, false), p0 - 0.01 * 0.1 * g / (std::sqrt(0.001) * g + 1e-8), 1e-6);
}

TEST(Reference, AdamL2VersusDecoupledWeightDecay) {
  // Adam folds wd * p into the gradient (moments see it); AdamW does not.
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    Mix mix{kind};
    CpuOptimizer opt = make_optimizer(kind, KernelPath::kScalar);
    TestState s(mix, 1);
    s.params()[0] = 2.0f;
    s.set_grad(0, 0.0f);
    store_as(DType::kF32, s.m(), 0, 0.0f);
    store_as(DType::kF32, s.v(), 0, 0.0f);
    StepArgs a;
    a.hyper = {.lr = 0.1, .weight_decay = 0.5};
    ASSERT_TRUE(opt.step(a, s.spans()).ok());
    const float m = static_cast<float*>(s.m())[0];
    if (kind == OptimizerKind::kAdam) {
      EXPECT_FLOAT_EQ(m, 0.1f * 1.0f);                     // g = 0 + 0.5 * 2
      EXPECT_NEAR(s.params()[0], 2.0 - 0.1, 1e-6);         // first Adam step moves lr * sign
    } else {
      EXPECT_EQ(m, 0.0f);
      EXPECT_FLOAT_EQ(s.params()[0], 2.0f * (1.0f - 0.05f));  // decay only, zero update
    }
  }
}

TEST(Optimizer, TileCallbacksCoverEveryElementOnceAndStateIsFinal) {
  for (int threads : {1, 2}) {
    Mix mix{OptimizerKind::kAdamW, DType::kBF16, DType::kF32, true};
    CpuOptimizer opt = make_optimizer(mix.kind, KernelPath::kAuto, threads, 256);
    TestState s(mix, 256 * 9 + 5), ref(mix, 256 * 9 + 5);
    s.fill(4);
    ref.fill(4);
    CpuOptimizer serial = make_optimizer(mix.kind, KernelPath::kAuto, 1, 256);
    ASSERT_TRUE(serial.step(StepArgs{}, ref.spans()).ok());
    std::mutex mu;
    std::vector<int> seen(s.count(), 0);
    std::set<size_t> tiles;
    size_t mismatched = 0;
    auto r = opt.step(StepArgs{}, s.spans(), [&](const TileRange& tile) {
      std::lock_guard<std::mutex> lock(mu);
      tiles.insert(tile.index);
      EXPECT_EQ(tile.begin, tile.index * 256);
      for (size_t i = tile.begin; i < tile.begin + tile.count; ++i) {
        seen[i]++;
        // The tile's copy is final when its callback runs.
        if (static_cast<uint16_t*>(s.copy())[i] != static_cast<uint16_t*>(ref.copy())[i]) mismatched++;
      }
    });
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->tiles, 10u);
    EXPECT_EQ(tiles.size(), 10u);
    EXPECT_EQ(mismatched, 0u);
    for (size_t i = 0; i < s.count(); ++i) ASSERT_EQ(seen[i], 1) << i;
    EXPECT_TRUE(s.snapshot() == ref.snapshot()) << "threads " << threads;
  }
}

TEST(Optimizer, FusedLossScaleAndClipEqualPrescaledGradients) {
  // g * (clip / scale) fused equals feeding the already-scaled gradient when
  // the factor is a power of two (exact either way).
  Mix mix{OptimizerKind::kAdamW};
  CpuOptimizer opt = make_optimizer(mix.kind, KernelPath::kAuto);
  TestState a(mix, 100), b(mix, 100);
  a.fill(8);
  b.fill(8);
  for (size_t i = 0; i < 100; ++i) static_cast<float*>(a.grads())[i] *= 4096.0f;
  for (size_t i = 0; i < 100; ++i) static_cast<float*>(b.grads())[i] *= 0.5f;
  StepArgs sa;
  sa.loss_scale = 4096.0;
  sa.clip_coefficient = 0.5;
  ASSERT_TRUE(opt.step(sa, a.spans()).ok());
  ASSERT_TRUE(opt.step(StepArgs{}, b.spans()).ok());
  for (size_t i = 0; i < 100; ++i) EXPECT_EQ(a.params()[i], b.params()[i]) << i;
}

TEST(Optimizer, BetaPowerHasNoDriftAtLargeSteps) {
  // Step 1e6 with beta2 = 0.999999: bias correction from pow, not from a
  // product accumulated over a million calls. One step from a fresh state
  // must equal the closed form.
  Mix mix{OptimizerKind::kAdam};
  CpuOptimizer opt = make_optimizer(mix.kind, KernelPath::kScalar);
  TestState s(mix, 1);
  s.params()[0] = 0.0f;
  s.set_grad(0, 1.0f);
  store_as(DType::kF32, s.m(), 0, 0.0f);
  store_as(DType::kF32, s.v(), 0, 0.0f);
  StepArgs a;
  a.step = 1000000;
  a.hyper = {.lr = 1.0, .beta1 = 0.9, .beta2 = 0.999999, .eps = 0.0};
  ASSERT_TRUE(opt.step(a, s.spans()).ok());
  const double bc1 = 1 - std::pow(0.9, 1e6), bc2 = 1 - std::pow(0.999999, 1e6);
  const double expected = -(1.0 / bc1 * 0.1) / (std::sqrt(1e-6) / std::sqrt(bc2));
  EXPECT_NEAR(s.params()[0], expected, 1e-6 * std::fabs(expected));
}

TEST(Optimizer, ResultsDoNotDependOnThreadsOrTiles) {
  Mix mix{OptimizerKind::kLion, DType::kF16, DType::kBF16, true, DType::kF16};
  TestState a(mix, 5000), b(mix, 5000);
  a.fill(21);
  b.fill(21);
  CpuOptimizer one = make_optimizer(mix.kind, KernelPath::kAuto, 1, 65536);
  CpuOptimizer two = make_optimizer(mix.kind, KernelPath::kAuto, 2, 64);
  for (int t = 1; t <= 3; ++t) {
    StepArgs s;
    s.step = t;
    ASSERT_TRUE(one.step(s, a.spans()).ok());
    ASSERT_TRUE(two.step(s, b.spans()).ok());
  }
  EXPECT_TRUE(a.snapshot() == b.snapshot());
  auto x = one.grad_stats(a.grads(), mix.grad, a.count());
  auto y = two.grad_stats(a.grads(), mix.grad, a.count());
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_NEAR(x->sum_squares, y->sum_squares, 1e-12 * x->sum_squares);
}

TEST(Optimizer, EmptyStepIsANoOp) {
  CpuOptimizer opt = make_optimizer(OptimizerKind::kAdamW, KernelPath::kAuto);
  auto r = opt.step(StepArgs{}, StateSpans{});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->tiles, 0u);
  EXPECT_FALSE(r->overflow);
}

TEST(Optimizer, BytesPerElementMatchesAccessPattern) {
  StateSpans s;
  s.count = 1;
  EXPECT_EQ(CpuOptimizer::bytes_per_element(OptimizerKind::kAdamW, s), 28u);  // 4 reads + 3 writes of fp32
  s.grad_dtype = DType::kBF16;
  s.param_copy = &s;  // any non-null pointer
  EXPECT_EQ(CpuOptimizer::bytes_per_element(OptimizerKind::kAdamW, s), 28u);  // 14 read, 14 written
  EXPECT_EQ(CpuOptimizer::bytes_per_element(OptimizerKind::kAdagrad, s), 20u);
  s.moment_dtype = DType::kBF16;
  EXPECT_EQ(CpuOptimizer::bytes_per_element(OptimizerKind::kLion, s), 16u);
}

// ---- Bad input: errors name the culprit and give a hint ----

void expect_error(const Status& st, StatusCode code, const std::string& needle) {
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.to_string() << " should mention " << needle;
}

TEST(OptimizerErrors, NullSpansNameTheField) {
  CpuOptimizer opt = make_optimizer(OptimizerKind::kAdamW, KernelPath::kAuto);
  Mix mix{OptimizerKind::kAdamW};
  TestState s(mix, 10);
  StateSpans spans = s.spans();
  spans.exp_avg_sq = nullptr;
  expect_error(opt.step(StepArgs{}, spans).status(), StatusCode::kInvalidArgument, "exp_avg_sq");
  spans = s.spans();
  spans.grads = nullptr;
  expect_error(opt.step(StepArgs{}, spans).status(), StatusCode::kInvalidArgument, "grads");
  spans = s.spans();
  spans.param_copy_dtype = DType::kF32;
  spans.param_copy = s.copy();
  expect_error(opt.step(StepArgs{}, spans).status(), StatusCode::kInvalidArgument, "param_copy_dtype");
  spans = s.spans();
  spans.moment_dtype = DType::kF16;
  expect_error(opt.step(StepArgs{}, spans).status(), StatusCode::kInvalidArgument, "moment_dtype");
  expect_error(opt.grad_stats(nullptr, DType::kF32, 3).status(), StatusCode::kInvalidArgument, "grads");
  // Adagrad needs no exp_avg, Lion no exp_avg_sq.
  CpuOptimizer adagrad = make_optimizer(OptimizerKind::kAdagrad, KernelPath::kAuto);
  spans = s.spans();
  spans.exp_avg = nullptr;
  EXPECT_TRUE(adagrad.step(StepArgs{}, spans).ok());
}

TEST(OptimizerErrors, BadArgumentsAndHyperParameters) {
  CpuOptimizer opt = make_optimizer(OptimizerKind::kAdamW, KernelPath::kAuto);
  Mix mix{OptimizerKind::kAdamW};
  TestState s(mix, 10);
  s.fill(1);
  const auto before = s.snapshot();
  auto with = [&](auto mutate) {
    StepArgs a;
    mutate(a);
    return opt.step(a, s.spans()).status();
  };
  expect_error(with([](StepArgs& a) { a.step = 0; }), StatusCode::kInvalidArgument, "step");
  expect_error(with([](StepArgs& a) { a.loss_scale = 0; }), StatusCode::kInvalidArgument, "loss_scale");
  expect_error(with([](StepArgs& a) { a.clip_coefficient = NAN; }), StatusCode::kInvalidArgument, "clip_coefficient");
  expect_error(with([](StepArgs& a) { a.hyper.lr = -1; }), StatusCode::kInvalidArgument, "lr");
  expect_error(with([](StepArgs& a) { a.hyper.beta1 = 1.0; }), StatusCode::kInvalidArgument, "beta1");
  expect_error(with([](StepArgs& a) { a.hyper.beta2 = -0.1; }), StatusCode::kInvalidArgument, "beta2");
  expect_error(with([](StepArgs& a) { a.hyper.eps = INFINITY; }), StatusCode::kInvalidArgument, "eps");
  expect_error(with([](StepArgs& a) { a.hyper.weight_decay = -0.01; }), StatusCode::kInvalidArgument, "weight_decay");
  EXPECT_TRUE(s.snapshot() == before);  // rejected steps write nothing
  EXPECT_EQ(validate_hyper_params(OptimizerKind::kAdagrad, {.eps = 0.0}).code(), StatusCode::kInvalidArgument);
}

TEST(OptimizerErrors, BadOptionsAndNames) {
  expect_error(CpuOptimizer::create({.tile_elements = 100}).status(), StatusCode::kInvalidArgument, "tile_elements");
  expect_error(CpuOptimizer::create({.tile_elements = (size_t{1} << 31) + 64}).status(), StatusCode::kInvalidArgument,
               "64..2147483648");
  expect_error(CpuOptimizer::create({.threads = -2}).status(), StatusCode::kInvalidArgument, "threads");
  expect_error(parse_optimizer_kind("adamax").status(), StatusCode::kInvalidArgument, "adamax");
  EXPECT_EQ(*parse_optimizer_kind("AdamW"), OptimizerKind::kAdamW);
  EXPECT_EQ(adam_kind(false), OptimizerKind::kAdam);
  expect_error(parse_kernel_path("sse4").status(), StatusCode::kInvalidArgument, "sse4");
  EXPECT_EQ(*parse_kernel_path("AVX512_BF16"), KernelPath::kAvx512Bf16);
}

TEST(KernelPaths, AutoPicksTheBestSupportedAndForcingWorks) {
  auto best = resolve_kernel_path(KernelPath::kAuto);
  ASSERT_TRUE(best.ok());
  EXPECT_EQ(best->path, supported_kernel_paths().back());
  EXPECT_FALSE(best->reason.empty());
  for (KernelPath p : supported_kernel_paths()) {
    auto forced = CpuOptimizer::create({.path = p});
    ASSERT_TRUE(forced.ok());
    EXPECT_EQ(forced->path(), p);
  }
  // The environment variable forces kAuto's choice.
  ::setenv("STRATA_CPU_ADAM_PATH", "scalar", 1);
  auto env = resolve_kernel_path(KernelPath::kAuto);
  ::setenv("STRATA_CPU_ADAM_PATH", "bogus", 1);
  auto bad = resolve_kernel_path(KernelPath::kAuto);
  ::unsetenv("STRATA_CPU_ADAM_PATH");
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->path, KernelPath::kScalar);
  EXPECT_NE(env->reason.find("STRATA_CPU_ADAM_PATH"), std::string::npos);
  expect_error(bad.status(), StatusCode::kInvalidArgument, "STRATA_CPU_ADAM_PATH");
}

TEST(KernelPaths, UnsupportedPathIsAnErrorNamingWhatIsMissing) {
  for (KernelPath p : {KernelPath::kAvx2, KernelPath::kAvx512, KernelPath::kAvx512Bf16}) {
    if (kernel_path_supported(p)) continue;
    auto r = resolve_kernel_path(p);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(r.status().message().find(kernel_path_name(p)), std::string::npos);
  }
  if (supported_kernel_paths().size() == 4) GTEST_SKIP() << "every path is supported on this machine";
}

}  // namespace
}  // namespace strata::cpu_adam::testing
