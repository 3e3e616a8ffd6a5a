// MomentStorage (cpu_adam/moment_storage.h): names, byte counts, spans
// pointed into a piece's moment buffers, and the fp32 conversions the
// engine's checkpoints use (int8: codes -> fp32 -> codes exact).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "strata/cpu_adam/moment_storage.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::cpu_adam {
namespace {

TEST(MomentStorage, ParsesTheConfigNamesAndRefusesOthersNamingTheKey) {
  for (const char* name : {"fp32", "bf16", "int8"}) {
    Result<MomentStorage> m = MomentStorage::parse(name, "strata.optimizer_state_dtype");
    ASSERT_TRUE(m.ok()) << name;
    EXPECT_EQ(m->name(), name);
  }
  Result<MomentStorage> bad = MomentStorage::parse("fp8\n", "strata.optimizer_state_dtype");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("strata.optimizer_state_dtype"), std::string::npos);
  EXPECT_NE(bad.status().message().find("\\x0a"), std::string::npos) << "control characters escaped";
  EXPECT_EQ(MomentStorage::parse("int8", "k")->block_elements(), kDefaultMomentBlockElements);
}

TEST(MomentStorage, BytesOfOneMoment) {
  EXPECT_EQ(MomentStorage::fp32().moment_bytes(1000), 4000u);
  EXPECT_EQ(MomentStorage::bf16().moment_bytes(1000), 2000u);
  // 1000 codes padded to 1024, then 4 scales.
  EXPECT_EQ(MomentStorage::int8().moment_bytes(1000), 1024u + 16u);
  EXPECT_EQ(MomentStorage::int8().moment_bytes(0), 0u);
  EXPECT_DOUBLE_EQ(MomentStorage::int8().bytes_per_element(), 2.0 + 8.0 / 256);
  EXPECT_DOUBLE_EQ(MomentStorage::fp32().bytes_per_element(), 8.0);
}

// A step over a piece's spans pointed at block offsets equals one step over
// the whole piece (the engine steps whole-block ranges of a piece).
TEST(MomentStorage, RangesPointedIntoAPieceStepLikeTheWholePiece) {
  const size_t n = 1000;
  const MomentStorage int8 = MomentStorage::int8();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> grads(n), params_a(n), params_b(n);
  for (size_t i = 0; i < n; ++i) {
    grads[i] = normal(rng);
    params_a[i] = params_b[i] = normal(rng);
  }
  std::vector<std::byte> ma(2 * int8.moment_bytes(n)), mb(ma.size());
  auto opt = CpuOptimizer::create({.kind = OptimizerKind::kAdamW, .threads = 1});
  ASSERT_TRUE(opt.ok());
  StepArgs args;
  args.hyper.lr = 1e-2;
  for (int step = 1; step <= 3; ++step) {
    args.step = step;
    StateSpans whole;
    whole.count = n;
    whole.params = params_a.data();
    whole.grads = grads.data();
    int8.point(whole, ma.data(), ma.data() + int8.moment_bytes(n), n, 0);
    ASSERT_TRUE(opt->step(args, whole).ok());
    for (size_t first : {size_t{0}, size_t{512}}) {
      StateSpans part;
      part.count = first == 0 ? 512 : n - 512;
      part.params = params_b.data() + first;
      part.grads = grads.data() + first;
      int8.point(part, mb.data(), mb.data() + int8.moment_bytes(n), n, first);
      ASSERT_TRUE(opt->step(args, part).ok());
    }
  }
  EXPECT_EQ(params_a, params_b);
  EXPECT_EQ(ma, mb);
}

TEST(MomentStorage, Int8ToFp32AndBackGivesTheSameCodesAndScales) {
  const size_t n = 700;
  const MomentStorage int8 = MomentStorage::int8();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    m[i] = 1e-3f * normal(rng);
    v[i] = 1e-6f * std::abs(normal(rng));
  }
  std::vector<std::byte> em(int8.moment_bytes(n)), ev(em.size());
  ASSERT_TRUE(int8.write_fp32(Int8Moment::kExpAvg, m.data(), n, 0, n, em.data()).ok());
  ASSERT_TRUE(int8.write_fp32(Int8Moment::kExpAvgSq, v.data(), n, 0, n, ev.data()).ok());
  std::vector<float> dm(n), dv(n);
  ASSERT_TRUE(int8.read_fp32(Int8Moment::kExpAvg, em.data(), n, 0, n, dm.data()).ok());
  ASSERT_TRUE(int8.read_fp32(Int8Moment::kExpAvgSq, ev.data(), n, 0, n, dv.data()).ok());
  for (size_t i = 0; i < n; ++i) EXPECT_LE(std::abs(dm[i] - m[i]), std::abs(m[i]) * 0.0625f + 1e-3f * 0x1p-17f) << i;
  std::vector<std::byte> em2(em.size()), ev2(ev.size());
  ASSERT_TRUE(int8.write_fp32(Int8Moment::kExpAvg, dm.data(), n, 0, n, em2.data()).ok());
  ASSERT_TRUE(int8.write_fp32(Int8Moment::kExpAvgSq, dv.data(), n, 0, n, ev2.data()).ok());
  EXPECT_EQ(em, em2);
  EXPECT_EQ(ev, ev2);
  // Ranges must be whole blocks (or reach the end).
  EXPECT_FALSE(int8.read_fp32(Int8Moment::kExpAvg, em.data(), n, 100, 256, dm.data()).ok());
  EXPECT_FALSE(int8.read_fp32(Int8Moment::kExpAvg, em.data(), n, 256, 600, dm.data()).ok());
  EXPECT_TRUE(int8.read_fp32(Int8Moment::kExpAvg, em.data(), n, 512, n - 512, dm.data()).ok());
}

TEST(MomentStorage, Bf16AndFp32ConvertElementwise) {
  const std::vector<float> in = {1.0f, -2.5f, 3.0e-5f, 0.0f};
  for (MomentStorage s : {MomentStorage::fp32(), MomentStorage::bf16()}) {
    std::vector<std::byte> buf(s.moment_bytes(in.size()));
    ASSERT_TRUE(s.write_fp32(Int8Moment::kExpAvg, in.data(), in.size(), 0, in.size(), buf.data()).ok());
    std::vector<float> out(in.size());
    ASSERT_TRUE(s.read_fp32(Int8Moment::kExpAvg, buf.data(), in.size(), 0, in.size(), out.data()).ok());
    for (size_t i = 0; i < in.size(); ++i) EXPECT_NEAR(out[i], in[i], std::abs(in[i]) / 128) << s.name();
  }
}

}  // namespace
}  // namespace strata::cpu_adam
