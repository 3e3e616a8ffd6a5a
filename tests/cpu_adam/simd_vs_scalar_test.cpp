// Every SIMD path against the scalar reference, element by element and bit
// for bit (Note [Update formulas] in cpu_adam/src/reference.cpp): every
// optimizer x grad dtype x moment dtype x param copy, odd lengths, unaligned
// starts, multi-step trajectories, the streaming probe and the norm pass.
// Paths this CPU cannot run skip.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "strata/cpu_adam/optimizer.h"
#include "test_state.h"

namespace strata::cpu_adam::testing {
namespace {

bool is_bf16_subnormal_or_zero(uint16_t bits) { return (bits & 0x7f80u) == 0; }

// Compares every element; with vcvtneps2bf16 a bf16 subnormal of the
// reference may come out as a zero of the same sign (documented).
void expect_same_state(TestState& ref, TestState& got, KernelPath path, const std::string& where) {
  const Mix& mix = ref.mix();
  const size_t n = ref.count();
  size_t bad = 0;
  auto report = [&](const char* what, size_t i, uint32_t a, uint32_t b) {
    if (++bad <= 5) ADD_FAILURE() << where << " " << mix_name(mix) << " path " << kernel_path_name(path) << ": " << what
                                  << "[" << i << "] reference 0x" << std::hex << a << " got 0x" << b << std::dec;
  };
  auto same16 = [&](uint16_t a, uint16_t b, bool bf16) {
    if (a == b) return true;
    return bf16 && path == KernelPath::kAvx512Bf16 && is_bf16_subnormal_or_zero(a) && (b & 0x7fffu) == 0 &&
           (a & 0x8000u) == (b & 0x8000u);
  };
  for (size_t i = 0; i < n; ++i) {
    uint32_t a, b;
    std::memcpy(&a, ref.params() + i, 4);
    std::memcpy(&b, got.params() + i, 4);
    if (a != b) report("params", i, a, b);
    for (int which = 0; which < 2; ++which) {
      if (which == 0 && mix.kind == OptimizerKind::kAdagrad) continue;
      if (which == 1 && mix.kind == OptimizerKind::kLion) continue;
      const void* rp = which == 0 ? ref.m() : ref.v();
      const void* gp = which == 0 ? got.m() : got.v();
      const char* name = which == 0 ? "exp_avg" : "exp_avg_sq";
      if (mix.int8) {
        const uint8_t x = static_cast<const uint8_t*>(rp)[i], y = static_cast<const uint8_t*>(gp)[i];
        if (x != y) report(name, i, x, y);
        const float* rs = which == 0 ? ref.m_scales() : ref.v_scales();
        const float* gs = which == 0 ? got.m_scales() : got.v_scales();
        if (i % mix.block == 0) {
          std::memcpy(&a, rs + i / mix.block, 4);
          std::memcpy(&b, gs + i / mix.block, 4);
          if (a != b) report(which == 0 ? "exp_avg_scale" : "exp_avg_sq_scale", i / mix.block, a, b);
        }
      } else if (mix.moment == DType::kF32) {
        std::memcpy(&a, static_cast<const float*>(rp) + i, 4);
        std::memcpy(&b, static_cast<const float*>(gp) + i, 4);
        if (a != b) report(name, i, a, b);
      } else {
        const uint16_t x = static_cast<const uint16_t*>(rp)[i], y = static_cast<const uint16_t*>(gp)[i];
        if (!same16(x, y, true)) report(name, i, x, y);
      }
    }
    if (mix.copy) {
      const uint16_t x = static_cast<const uint16_t*>(ref.copy())[i];
      const uint16_t y = static_cast<const uint16_t*>(got.copy())[i];
      if (!same16(x, y, mix.copy_dtype == DType::kBF16)) report("param_copy", i, x, y);
    }
  }
  EXPECT_EQ(bad, 0u) << where << " " << mix_name(mix) << ": " << bad << " elements differ";
}

StepArgs args_for(int64_t step) {
  StepArgs a;
  a.step = step;
  a.hyper = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .bias_correction = true};
  a.overflow_check = OverflowCheck::kAssumeFinite;
  return a;
}

class SimdVsScalar : public ::testing::TestWithParam<KernelPath> {
 protected:
  void SetUp() override {
    if (!kernel_path_supported(GetParam()))
      GTEST_SKIP() << "kernel path " << kernel_path_name(GetParam()) << " not supported by this CPU or build";
  }
};

TEST_P(SimdVsScalar, AllMixesOddLengthsUnalignedStarts) {
  const KernelPath path = GetParam();
  for (const Mix& mix : all_mixes()) {
    CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar);
    CpuOptimizer simd = make_optimizer(mix.kind, path);
    for (size_t count : {1, 7, 8, 15, 16, 17, 31, 33, 47, 64, 1031}) {
      for (size_t misalign : {0, 1, 3}) {
        TestState ref(mix, count, misalign), got(mix, count, misalign);
        ref.fill(static_cast<uint32_t>(count * 7 + misalign));
        got.fill(static_cast<uint32_t>(count * 7 + misalign));
        const StepArgs a = args_for(3);
        ASSERT_TRUE(scalar.step(a, ref.spans()).ok());
        ASSERT_TRUE(simd.step(a, got.spans()).ok());
        expect_same_state(ref, got, path, "count " + std::to_string(count) + " misalign " + std::to_string(misalign));
        if (HasFailure()) return;
      }
    }
  }
}

TEST_P(SimdVsScalar, MultiStepTrajectoryWithSchedulesScalingAndThreads) {
  const KernelPath path = GetParam();
  for (const Mix& mix : all_mixes()) {
    CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar, 1, 64);
    CpuOptimizer simd = make_optimizer(mix.kind, path, 2, 128);  // tiles of 128 on 2 threads
    const size_t count = 1000 + 3;
    TestState ref(mix, count, 1), got(mix, count, 1);
    ref.fill(11);
    got.fill(11);
    for (int64_t t = 1; t <= 12; ++t) {
      StepArgs a = args_for(t);
      a.hyper.lr = 1e-2 * (1.0 - 0.05 * static_cast<double>(t));  // a schedule
      a.hyper.weight_decay = t % 2 ? 0.0 : 0.05;
      a.hyper.bias_correction = t % 5 != 0;
      a.loss_scale = 1024.0;
      a.clip_coefficient = t % 3 ? 1.0 : 0.5;
      ref.fill_grads(100 + t, 1024.0f * 0.1f);  // loss-scaled grads (fit fp16)
      got.fill_grads(100 + t, 1024.0f * 0.1f);
      ASSERT_TRUE(scalar.step(a, ref.spans()).ok());
      ASSERT_TRUE(simd.step(a, got.spans()).ok());
      expect_same_state(ref, got, path, "step " + std::to_string(t));
      if (HasFailure()) return;
    }
  }
}

TEST_P(SimdVsScalar, StreamProbeMatchesScalarProbe) {
  const KernelPath path = GetParam();
  for (const Mix& mix : all_mixes()) {
    CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar);
    CpuOptimizer simd = make_optimizer(mix.kind, path);
    TestState ref(mix, 77, 1), got(mix, 77, 1);
    ref.fill(5);
    got.fill(5);
    ASSERT_TRUE(scalar.stream_probe(ref.spans()).ok());
    ASSERT_TRUE(simd.stream_probe(got.spans()).ok());
    expect_same_state(ref, got, path, "probe");
    if (HasFailure()) return;
  }
}

TEST_P(SimdVsScalar, SpecialGradientValues) {
  // Zeros, signed zeros, fp16 subnormals, values at the edge of fp16's range,
  // tiny and huge finite values: all finite, so the step must run and agree.
  const KernelPath path = GetParam();
  const float specials[] = {0.0f, -0.0f, 6.0e-8f, -6.0e-8f, 65504.0f, -65504.0f, 1e-30f, 3.0e38f, 1.0f, -1.0f};
  for (const Mix& mix : all_mixes()) {
    CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar);
    CpuOptimizer simd = make_optimizer(mix.kind, path);
    TestState ref(mix, 40, 0), got(mix, 40, 0);
    ref.fill(3);
    got.fill(3);
    for (size_t i = 0; i < 40; ++i) {
      float x = specials[i % 10];
      if (mix.grad == DType::kF16 && std::fabs(x) > 65504.0f) x = 1.0f;
      ref.set_grad(i, x);
      got.set_grad(i, x);
    }
    StepArgs a = args_for(2);
    a.overflow_check = OverflowCheck::kScanFirst;
    auto r1 = scalar.step(a, ref.spans());
    auto r2 = simd.step(a, got.spans());
    ASSERT_TRUE(r1.ok() && r2.ok());
    EXPECT_EQ(r1->overflow, r2->overflow);
    expect_same_state(ref, got, path, "specials");
    if (HasFailure()) return;
  }
}

TEST_P(SimdVsScalar, EveryInt8CodeDecodesLikeTheReference) {
  // The SIMD paths decode codes through the fp16 conversion (Note [Codes
  // through fp16]); every one of the 256 codes of each moment (subnormal
  // codes, signed zero, codes above 1.0 that no step writes) is read by the
  // conversion probe (decode, add, encode) and by a step, both compared with
  // the reference's integer decode bit for bit.
  const KernelPath path = GetParam();
  for (const Mix& mix : all_mixes()) {
    if (!mix.int8) continue;
    constexpr size_t kCount = 4 * 256 + 7;  // a partial last block too
    for (int pass = 0; pass < 2; ++pass) {
      CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar);
      CpuOptimizer simd = make_optimizer(mix.kind, path);
      TestState ref(mix, kCount, 3), got(mix, kCount, 3);
      ref.fill(11);
      got.fill(11);
      for (TestState* s : {&ref, &got}) {
        for (size_t i = 0; i < kCount; ++i) {
          static_cast<uint8_t*>(s->m())[i] = static_cast<uint8_t>(i % 256);
          static_cast<uint8_t*>(s->v())[i] = static_cast<uint8_t>((i * 37 + i / 256) % 256);
        }
        for (size_t b = 0; b < moment_block_count(kCount, mix.block); ++b) {
          s->m_scales()[b] = 0.03f * static_cast<float>(b + 1);
          s->v_scales()[b] = 0.002f / static_cast<float>(b + 1);
        }
      }
      if (pass == 0) {
        ASSERT_TRUE(scalar.stream_probe(ref.spans(), false, ProbeKind::kConversion).ok());
        ASSERT_TRUE(simd.stream_probe(got.spans(), false, ProbeKind::kConversion).ok());
      } else {
        ASSERT_TRUE(scalar.step(args_for(3), ref.spans()).ok());
        ASSERT_TRUE(simd.step(args_for(3), got.spans()).ok());
      }
      expect_same_state(ref, got, path, pass == 0 ? "every code, conversion probe" : "every code, step");
      if (HasFailure()) return;
    }
  }
}

TEST_P(SimdVsScalar, GradStatsMatchReference) {
  const KernelPath path = GetParam();
  for (DType g : {DType::kF32, DType::kBF16, DType::kF16}) {
    Mix mix{OptimizerKind::kAdamW, g};
    CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar, 1, 64);
    CpuOptimizer simd = make_optimizer(mix.kind, path, 2, 128);
    for (size_t count : {1, 15, 17, 33, 1000, 4099}) {
      TestState s(mix, count, 1);
      s.fill(static_cast<uint32_t>(count), 2.0f);
      auto a = scalar.grad_stats(s.grads(), g, count);
      auto b = simd.grad_stats(s.grads(), g, count);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_TRUE(a->all_finite && b->all_finite);
      EXPECT_NEAR(a->sum_squares, b->sum_squares, 1e-12 * a->sum_squares) << dtype_name(g) << " count " << count;
      // Any Inf or NaN, anywhere, makes the stats non-finite.
      for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN()}) {
        const size_t at = count / 2;
        const float keep = load_as(g, s.grads(), at);
        s.set_grad(at, bad);
        auto c = simd.grad_stats(s.grads(), g, count);
        ASSERT_TRUE(c.ok());
        EXPECT_FALSE(c->all_finite) << dtype_name(g) << " count " << count << " value " << bad;
        s.set_grad(at, keep);
      }
    }
  }
}

// Note [Out-of-place steps]: reading the state from sources and writing the
// new state elsewhere gives the in-place step's bits, on every path, and
// leaves the sources as they were.
// `outputs` reading the state (and gradients) of `from`: an out-of-place step's spans.
StateSpans reading_from(StateSpans outputs, const StateSpans& from) {
  outputs.grads = from.grads;
  outputs.params_source = from.params;
  outputs.exp_avg_source = from.exp_avg;
  outputs.exp_avg_sq_source = from.exp_avg_sq;
  outputs.exp_avg_scale_source = from.exp_avg_scale;
  outputs.exp_avg_sq_scale_source = from.exp_avg_sq_scale;
  return outputs;
}

class OutOfPlace : public ::testing::TestWithParam<KernelPath> {
 protected:
  void SetUp() override {
    if (!kernel_path_supported(GetParam()))
      GTEST_SKIP() << "kernel path " << kernel_path_name(GetParam()) << " not supported by this CPU or build";
  }
};

TEST_P(OutOfPlace, EqualsInPlaceBitForBitAndLeavesTheSourcesUnchanged) {
  const KernelPath path = GetParam();
  for (const Mix& mix : all_mixes()) {
    // Tiles of 128 on 2 threads: the sources are offset per tile like the
    // outputs. Misalign 0: aligned outputs, stored non-temporally (Note
    // [Out-of-place steps]); 3: normal stores.
    CpuOptimizer opt = make_optimizer(mix.kind, path, 2, 128);
    for (size_t count : {1, 17, 33, 1003}) {
      for (size_t misalign : {0, 3}) {
        const uint32_t seed = static_cast<uint32_t>(count * 13 + misalign);
        TestState in_place(mix, count, misalign), source(mix, count, misalign), pristine(mix, count, misalign),
            out(mix, count, misalign);
        in_place.fill(seed);
        source.fill(seed);
        pristine.fill(seed);
        out.fill(seed + 1000);  // other values everywhere: every output element must be written
        StepArgs a = args_for(4);
        a.loss_scale = 8.0;
        a.clip_coefficient = 0.75;
        ASSERT_TRUE(opt.step(a, in_place.spans()).ok());
        ASSERT_TRUE(opt.step(a, reading_from(out.spans(), source.spans())).ok());
        const std::string where = "count " + std::to_string(count) + " misalign " + std::to_string(misalign);
        // The same path on both sides: exact, no subnormal allowance needed.
        expect_same_state(in_place, out, KernelPath::kScalar, "out of place, " + where);
        expect_same_state(pristine, source, KernelPath::kScalar, "the source after the step, " + where);
        if (HasFailure()) return;
      }
    }
  }
}

// The streaming probe out of place: every source byte lands in its output
// (the state copied, the copy stream overwritten), the sources unchanged,
// the same on every path as the scalar reference's.
TEST_P(OutOfPlace, StreamProbeCopiesTheSourcesToTheOutputs) {
  const KernelPath path = GetParam();
  for (const Mix& mix : all_mixes()) {
    CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar);
    CpuOptimizer opt = make_optimizer(mix.kind, path, 2, 128);
    for (size_t misalign : {0, 3}) {
      const size_t count = 1003;
      TestState source(mix, count, misalign), pristine(mix, count, misalign), out(mix, count, misalign),
          ref_out(mix, count, misalign);
      source.fill(9);
      pristine.fill(9);
      out.fill(77);
      ref_out.fill(77);
      ASSERT_TRUE(scalar.stream_probe(reading_from(ref_out.spans(), source.spans())).ok());
      ASSERT_TRUE(opt.stream_probe(reading_from(out.spans(), source.spans())).ok());
      const std::string where = "misalign " + std::to_string(misalign);
      expect_same_state(ref_out, out, KernelPath::kScalar, "probe out of place vs scalar, " + where);
      expect_same_state(pristine, source, KernelPath::kScalar, "the source after the probe, " + where);
      // The state streams are the source's (the copy stream holds the params' low bits instead).
      EXPECT_EQ(0, std::memcmp(out.params(), source.params(), count * 4)) << mix_name(mix) << " " << where;
      if (HasFailure()) return;
    }
  }
}

TEST(OutOfPlaceSpans, PartialOrOverlappingSourcesAreRefusedNamingTheField) {
  const Mix mix{OptimizerKind::kAdamW, DType::kF32};
  CpuOptimizer opt = make_optimizer(mix.kind, KernelPath::kScalar);
  TestState state(mix, 64), source(mix, 64);
  state.fill(1);
  source.fill(1);
  const StateSpans from = source.spans();
  auto refused = [&](StateSpans sp, const std::string& field) {
    const Result<StepReport> r = opt.step(args_for(1), sp);
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
  };
  StateSpans moments_only = state.spans();
  moments_only.exp_avg_source = from.exp_avg;
  refused(moments_only, "params_source");
  StateSpans missing = state.spans();
  missing.params_source = from.params;
  missing.exp_avg_source = from.exp_avg;
  refused(missing, "exp_avg_sq_source");
  StateSpans overlapping = state.spans();
  overlapping.params_source = state.params() + 1;
  overlapping.exp_avg_source = from.exp_avg;
  overlapping.exp_avg_sq_source = from.exp_avg_sq;
  refused(overlapping, "params_source");
  // The same span as source and output is an in-place step.
  StateSpans same = state.spans();
  same.params_source = same.params;
  same.exp_avg_source = same.exp_avg;
  same.exp_avg_sq_source = same.exp_avg_sq;
  EXPECT_TRUE(opt.step(args_for(1), same).ok());
}

INSTANTIATE_TEST_SUITE_P(Paths, OutOfPlace,
                         ::testing::Values(KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512,
                                           KernelPath::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<KernelPath>& info) {
                           return std::string(kernel_path_name(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(Paths, SimdVsScalar,
                         ::testing::Values(KernelPath::kAvx2, KernelPath::kAvx512, KernelPath::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<KernelPath>& info) {
                           return std::string(kernel_path_name(info.param));
                         });

TEST(SimdVsScalar, Avx512Bf16FlushesBf16SubnormalsOnlyThere) {
  // Documents the one difference the comparison above allows: a bf16
  // subnormal result (|x| < 2^-126) becomes a signed zero with vcvtneps2bf16.
  if (!kernel_path_supported(KernelPath::kAvx512Bf16)) GTEST_SKIP() << "no avx512bf16";
  Mix mix{OptimizerKind::kLion, DType::kF32, DType::kBF16};
  CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar);
  CpuOptimizer simd = make_optimizer(mix.kind, KernelPath::kAvx512Bf16);
  CpuOptimizer avx512 = make_optimizer(mix.kind, KernelPath::kAvx512);
  TestState a(mix, 16), b(mix, 16), c(mix, 16);
  for (TestState* s : {&a, &b, &c}) {
    s->fill(1);
    for (size_t i = 0; i < 16; ++i) {
      store_as(DType::kBF16, s->m(), i, 0.0f);
      s->set_grad(i, 1e-38f);  // m = 0.01 * 1e-38: a bf16 subnormal
    }
  }
  StepArgs args = args_for(1);
  args.hyper.beta2 = 0.99;
  ASSERT_TRUE(scalar.step(args, a.spans()).ok());
  ASSERT_TRUE(simd.step(args, b.spans()).ok());
  ASSERT_TRUE(avx512.step(args, c.spans()).ok());
  const uint16_t ref = static_cast<const uint16_t*>(a.m())[0];
  EXPECT_TRUE(is_bf16_subnormal_or_zero(ref) && ref != 0);
  EXPECT_EQ(static_cast<const uint16_t*>(b.m())[0], 0);
  EXPECT_EQ(static_cast<const uint16_t*>(c.m())[0], ref);  // integer rounding keeps it
}

}  // namespace
}  // namespace strata::cpu_adam::testing
