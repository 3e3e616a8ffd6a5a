// The streaming probe (the ceiling of `strata bench cpu-adam`) must move
// exactly the bytes the optimizer step moves, no more and no fewer, and do
// nothing else to the state (Note [Streaming probe], x86/kernel_body.h).
//
// Bytes are counted by instantiating the SIMD kernel body -- the same
// template every x86 path is built from -- over a one-lane ISA whose loads
// and stores record (address, size, read/write). Each real path is then
// checked for the probe's observable effects: params, grads and moments
// bit-identical, the copy = low 16 bits of each param, nothing written past
// the span.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "../../cpu_adam/src/x86/kernel_body.h"
#include "strata/cpu_adam/optimizer.h"
#include "test_state.h"

namespace strata::cpu_adam::testing {
namespace {

struct Access {
  uintptr_t address;
  size_t bytes;
  bool write;
  bool operator<(const Access& o) const {
    return std::tie(address, bytes, write) < std::tie(o.address, o.bytes, o.write);
  }
  bool operator==(const Access& o) const {
    return address == o.address && bytes == o.bytes && write == o.write;
  }
};

std::vector<Access>& access_log() {
  static std::vector<Access> log;
  return log;
}
void record(const void* p, size_t bytes, bool write) {
  access_log().push_back(Access{reinterpret_cast<uintptr_t>(p), bytes, write});
}

// One lane; every memory access goes through record().
struct CountingIsa {
  using V = float;
  using R32 = uint32_t;
  using R16 = uint16_t;
  static constexpr size_t kWidth = 1;

  static V load_f32(const float* p) {
    record(p, 4, false);
    return *p;
  }
  static void store_f32(float* p, V x) {
    record(p, 4, true);
    *p = x;
  }
  static V load_bf16(const uint16_t* p) {
    record(p, 2, false);
    return bf16_bits_to_fp32(*p);
  }
  static void store_bf16(uint16_t* p, V x) {
    record(p, 2, true);
    *p = fp32_to_bf16_bits(x);
  }
  static V load_f16(const uint16_t* p) {
    record(p, 2, false);
    return fp16_bits_to_fp32(*p);
  }
  static void store_f16(uint16_t* p, V x) {
    record(p, 2, true);
    *p = fp32_to_fp16_bits(x);
  }
  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  static V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
  static V sign(V x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

  static R32 load_raw32(const void* p) {
    record(p, 4, false);
    R32 x;
    std::memcpy(&x, p, 4);
    return x;
  }
  static void store_raw32(void* p, R32 x) {
    record(p, 4, true);
    std::memcpy(p, &x, 4);
  }
  static R16 load_raw16(const void* p) {
    record(p, 2, false);
    R16 x;
    std::memcpy(&x, p, 2);
    return x;
  }
  static void store_raw16(void* p, R16 x) {
    record(p, 2, true);
    std::memcpy(p, &x, 2);
  }
  template <class R>
  static void keep(R&) {}
  static R16 low16(R32 x) { return static_cast<R16>(x); }
  static R16 bf16_bits(V x) { return fp32_to_bf16_bits(x); }
  static R16 f16_bits(V x) { return fp32_to_fp16_bits(x); }
  static void stream_raw16(void* p, R16 x) { store_raw16(p, x); }
  static void stream_f32(float* p, V x) { store_f32(p, x); }
  static void stream_raw32(void* p, R32 x) { store_raw32(p, x); }
  static void store_fence() {}

  // 8-bit moments.
  using VI = uint32_t;
  using R8 = uint8_t;
  static VI set1i(uint32_t x) { return x; }
  static VI as_int(V x) { return std::bit_cast<uint32_t>(x); }
  static VI and_i(VI a, VI b) { return a & b; }
  static VI add_i(VI a, VI b) { return a + b; }
  template <int S>
  static VI srli(VI a) { return a >> S; }
  static VI min_u32(VI a, VI b) { return std::min(a, b); }
  static VI max_u32(VI a, VI b) { return std::max(a, b); }
  template <class Code, bool kSigned>
  static V load_codes(const uint8_t* p) {  // the reference's decode (int8_format.h), unscaled
    record(p, 1, false);
    return kSigned ? detail::decode_exp_avg(*p, 1.0f) : Code::decode(*p);
  }
  static void store_u8(uint8_t* p, VI x) {
    record(p, 1, true);
    *p = static_cast<uint8_t>(x);
  }
  static void store_u8x4(uint8_t* p, VI a, VI b, VI c, VI d) {
    store_u8(p, a);
    store_u8(p + 1, b);
    store_u8(p + 2, c);
    store_u8(p + 3, d);
  }
  static VI or_bit7(VI a, VI b) { return a | (b & 0x80u); }
  static uint32_t hmax_u32(VI x) { return x; }
  static R8 load_raw8(const void* p) {
    record(p, 1, false);
    return *static_cast<const uint8_t*>(p);
  }
  static void store_raw8(void* p, R8 x) {
    record(p, 1, true);
    *static_cast<uint8_t*>(p) = x;
  }
  static float load_scale(const float* p) {
    record(p, 4, false);
    return *p;
  }
  static void store_scale(float* p, float x) {
    record(p, 4, true);
    *p = x;
  }
};

using CountingKernels = detail::Kernels<CountingIsa>;

detail::TileSpans tile_of(const StateSpans& s) {
  detail::TileSpans t;
  t.count = s.count;
  t.params = s.params;
  t.grads = s.grads;
  t.grad_dtype = s.grad_dtype;
  t.exp_avg = s.exp_avg;
  t.exp_avg_sq = s.exp_avg_sq;
  t.moment_dtype = s.moment_dtype;
  t.param_copy = s.param_copy;
  if (s.moment_format == MomentFormat::kBlockInt8) {
    t.block_elements = s.moment_block_elements;
    t.exp_avg_scale = s.exp_avg_scale;
    t.exp_avg_sq_scale = s.exp_avg_sq_scale;
  }
  if (s.param_copy != nullptr)
    t.copy_type = s.param_copy_dtype == DType::kBF16 ? detail::CopyType::kBF16 : detail::CopyType::kF16;
  t.params_in = t.params;  // in place
  t.exp_avg_in = t.exp_avg;
  t.exp_avg_sq_in = t.exp_avg_sq;
  t.exp_avg_scale_in = t.exp_avg_scale;
  t.exp_avg_sq_scale_in = t.exp_avg_sq_scale;
  return t;
}

detail::StepFactors factors_for(OptimizerKind kind) {
  detail::StepFactors f;
  f.kind = kind;
  f.neg_lr = -1e-3f;
  f.one_minus_beta1 = 0.1f;
  f.beta2 = 0.999f;
  f.one_minus_beta2 = 0.001f;
  f.eps = 1e-8f;
  f.weight_decay = 0.01f;
  f.l2_decay = kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdagrad;
  f.decay_factor = 0.99999f;
  f.decoupled_decay = !f.l2_decay;
  f.neg_step_size = -1e-2f;
  f.inv_bias_correction2_sqrt = 30.0f;
  return f;
}

// The accesses to the state's memory (the int8 update also keeps a block
// of m and sqrt(v) in a stack buffer, which is not traffic to memory).
std::vector<Access> run_logged(void (*pass)(const detail::StepFactors&, const detail::TileSpans&),
                               const detail::StepFactors& f, const detail::TileSpans& t, const TestState& state) {
  access_log().clear();
  pass(f, t);
  std::vector<Access> log;
  for (const Access& a : access_log())
    if (state.owns(reinterpret_cast<const void*>(a.address))) log.push_back(a);
  std::sort(log.begin(), log.end());
  return log;
}

size_t total_bytes(const std::vector<Access>& log, bool write) {
  size_t n = 0;
  for (const Access& a : log) n += a.write == write ? a.bytes : 0;
  return n;
}

TEST(StreamingProbeBytes, MovesExactlyTheBytesOfTheStep) {
  for (const Mix& mix : all_mixes()) {
    for (bool prefetch : {false, true}) {
      const size_t count = 37;
      TestState state(mix, count, 1);
      state.fill(9);
      const StateSpans spans = state.spans();
      detail::StepFactors f = factors_for(mix.kind);
      f.probe_prefetch = prefetch;
      const detail::TileSpans t = tile_of(spans);
      const std::vector<Access> step = run_logged(&CountingKernels::update, f, t, state);
      const std::vector<Access> stream = run_logged(&CountingKernels::stream, f, t, state);
      const std::vector<Access> conversion = run_logged(&CountingKernels::probe, f, t, state);
      // The same bytes at the same addresses, each read and written as often.
      EXPECT_TRUE(step == stream) << mix_name(mix) << ": the streaming probe's accesses differ from the step's";
      EXPECT_TRUE(step == conversion) << mix_name(mix) << ": the conversion probe's accesses differ";
      // And that is what the bench divides by: bytes_per_step.
      const size_t expected = CpuOptimizer::bytes_per_step(mix.kind, spans);
      EXPECT_EQ(total_bytes(stream, false) + total_bytes(stream, true), expected) << mix_name(mix);
      EXPECT_EQ(total_bytes(step, false) + total_bytes(step, true), expected) << mix_name(mix);
      if (HasFailure()) return;
    }
  }
}

TEST(StreamingProbeBytes, CountsDistinguishAMissingStream) {
  // The comparison above can fail: a probe without the copy stream moves
  // fewer bytes than a step with it.
  Mix with_copy{OptimizerKind::kAdamW, DType::kBF16, DType::kF32, true};
  TestState state(with_copy, 16);
  state.fill(1);
  StateSpans spans = state.spans();
  const detail::StepFactors f = factors_for(with_copy.kind);
  const auto step = run_logged(&CountingKernels::update, f, tile_of(spans), state);
  spans.param_copy = nullptr;
  const auto stream = run_logged(&CountingKernels::stream, f, tile_of(spans), state);
  EXPECT_FALSE(step == stream);
  EXPECT_EQ(total_bytes(step, true) - total_bytes(stream, true), 16u * 2);
}

class StreamingProbeOnPath : public ::testing::TestWithParam<KernelPath> {
 protected:
  void SetUp() override {
    if (!kernel_path_supported(GetParam()))
      GTEST_SKIP() << "kernel path " << kernel_path_name(GetParam()) << " not supported by this CPU or build";
  }
};

TEST_P(StreamingProbeOnPath, LeavesTheStateUnchangedAndWritesOnlyTheCopy) {
  const KernelPath path = GetParam();
  constexpr size_t kGuard = 24;
  for (const Mix& mix : all_mixes()) {
    for (int threads : {1, 2}) {
      CpuOptimizer opt = make_optimizer(mix.kind, path, threads, 128);
      for (size_t count : {1, 7, 16, 17, 33, 1031}) {
        for (size_t misalign : {0, 3}) {
          TestState state(mix, count + kGuard, misalign);
          state.fill(static_cast<uint32_t>(count + misalign));
          std::memset(state.copy(), 0xa5, (count + kGuard) * 2);
          const auto before = state.snapshot();
          StateSpans spans = state.spans();
          spans.count = count;  // the guard elements after the span must stay as they are
          for (bool prefetch : {false, true}) ASSERT_TRUE(opt.stream_probe(spans, prefetch).ok());
          const auto after = state.snapshot();
          const std::string where = mix_name(mix) + " path " + std::string(kernel_path_name(path)) + " count " +
                                    std::to_string(count) + " threads " + std::to_string(threads);
          for (int buffer : {0, 1, 2, 3, 5, 6})  // params, grads, m, v, scales: all but the copy
            EXPECT_TRUE(before[buffer] == after[buffer]) << where << ": buffer " << buffer << " changed";
          const auto* copy = static_cast<const uint16_t*>(state.copy());
          for (size_t i = 0; i < count + kGuard; ++i) {
            uint32_t bits;
            std::memcpy(&bits, state.params() + i, 4);
            const uint16_t want = mix.copy && i < count ? static_cast<uint16_t>(bits) : uint16_t{0xa5a5};
            if (copy[i] != want) {
              ADD_FAILURE() << where << ": copy[" << i << "] = 0x" << std::hex << copy[i] << ", want 0x" << want;
              break;
            }
          }
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST_P(StreamingProbeOnPath, ConversionProbeMatchesScalar) {
  const KernelPath path = GetParam();
  for (const Mix& mix : all_mixes()) {
    CpuOptimizer scalar = make_optimizer(mix.kind, KernelPath::kScalar);
    CpuOptimizer simd = make_optimizer(mix.kind, path);
    TestState ref(mix, 77, 1), got(mix, 77, 1);
    ref.fill(5);
    got.fill(5);
    ASSERT_TRUE(scalar.stream_probe(ref.spans(), false, ProbeKind::kConversion).ok());
    ASSERT_TRUE(simd.stream_probe(got.spans(), true, ProbeKind::kConversion).ok());
    // Without bf16 subnormals in play (values ~1e-2..1), every byte agrees.
    EXPECT_TRUE(ref.snapshot() == got.snapshot()) << mix_name(mix) << " path " << kernel_path_name(path);
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, StreamingProbeOnPath,
                         ::testing::Values(KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512,
                                           KernelPath::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<KernelPath>& info) {
                           return std::string(kernel_path_name(info.param));
                         });

TEST(StreamingProbe, ProbeKindNames) {
  EXPECT_EQ(probe_kind_name(ProbeKind::kStreaming), "streaming");
  EXPECT_EQ(probe_kind_name(ProbeKind::kConversion), "conversion");
}

}  // namespace
}  // namespace strata::cpu_adam::testing
