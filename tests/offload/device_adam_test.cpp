// The device optimizer (strata/offload/device_adam.h): argument checks and
// the host reference run everywhere; the fused CUDA kernel is compared bit
// for bit with the reference (params, both moments, the 16-bit copy) on a
// GPU and skipped cleanly without one.

#include "strata/offload/device_adam.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#if STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "strata/core/device_registry.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::offload {
namespace {

using cpu_adam::OptimizerKind;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// Host-side state of one tensor, in the dtypes of a test case.

struct HostTensor {
  std::vector<float> params;
  std::vector<unsigned char> grads, exp_avg, exp_avg_sq, param_copy;
  size_t count = 0;
};

std::vector<unsigned char> encode(const std::vector<float>& values, DType dtype) {
  std::vector<unsigned char> out(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t bits = dtype == DType::kBF16 ? fp32_to_bf16_bits(values[i]) : fp32_to_fp16_bits(values[i]);
      std::memcpy(out.data() + 2 * i, &bits, 2);
    }
  }
  return out;
}

HostTensor make_tensor(size_t count, const DeviceAdamArgs& args, bool with_copy, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> param(-1.0f, 1.0f), moment(-0.01f, 0.01f), second(0.0f, 1e-4f);
  HostTensor t;
  t.count = count;
  std::vector<float> m(count), v(count);
  t.params.resize(count);
  for (size_t i = 0; i < count; ++i) {
    t.params[i] = param(rng);
    m[i] = moment(rng);
    v[i] = second(rng);
  }
  if (args.moments.blocked()) {  // codes and scales in MomentStorage's layout, from the fp32 values
    t.exp_avg.assign(args.moments.moment_bytes(count), 0);
    t.exp_avg_sq.assign(args.moments.moment_bytes(count), 0);
    EXPECT_TRUE(args.moments.write_fp32(cpu_adam::Int8Moment::kExpAvg, m.data(), count, 0, count, t.exp_avg.data())
                    .ok());
    EXPECT_TRUE(
        args.moments.write_fp32(cpu_adam::Int8Moment::kExpAvgSq, v.data(), count, 0, count, t.exp_avg_sq.data())
            .ok());
  } else {
    t.exp_avg = encode(m, args.moments.element_dtype());
    t.exp_avg_sq = encode(v, args.moments.element_dtype());
  }
  if (with_copy) t.param_copy.assign(count * 2, 0xab);
  return t;
}

// Fresh gradients for a step, scaled by the loss scale (what backward wrote).
void fill_grads(HostTensor& t, const DeviceAdamArgs& args, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> g(t.count);
  for (float& x : g) x = normal(rng) * 0.05f * static_cast<float>(args.loss_scale);
  t.grads = encode(g, args.grad_dtype);
}

DeviceAdamTensor view(HostTensor& t) {
  return {t.params.data(), t.grads.data(), t.exp_avg.data(), t.exp_avg_sq.data(),
          t.param_copy.empty() ? nullptr : t.param_copy.data(), t.count};
}

DeviceAdamArgs base_args() {
  DeviceAdamArgs a;
  a.kind = OptimizerKind::kAdamW;
  a.hyper = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
  return a;
}

// ---------------------------------------------------------------------------
// Argument checks (run everywhere).

TEST(DeviceAdamValidate, OnlyAdamAndAdamWHaveAKernel) {
  float p = 0, g = 0, m = 0, v = 0;
  const DeviceAdamTensor t{&p, &g, &m, &v, nullptr, 1};
  for (OptimizerKind kind : {OptimizerKind::kLion, OptimizerKind::kAdagrad}) {
    DeviceAdamArgs a = base_args();
    a.kind = kind;
    const Status s = validate_device_adam(a, {&t, 1});
    EXPECT_EQ(s.code(), StatusCode::kUnsupported);
    EXPECT_THAT(s.message(), HasSubstr(std::string(cpu_adam::optimizer_kind_name(kind))));
    EXPECT_THAT(s.message(), HasSubstr("adam and adamw only"));
    EXPECT_EQ(device_adam_reference(a, {&t, 1}).code(), StatusCode::kUnsupported);
  }
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    DeviceAdamArgs a = base_args();
    a.kind = kind;
    EXPECT_TRUE(validate_device_adam(a, {&t, 1}).ok());
  }
}

TEST(DeviceAdamValidate, DtypesNamed) {
  float p = 0, g = 0, m = 0, v = 0;
  uint16_t copy = 0;
  const DeviceAdamTensor plain{&p, &g, &m, &v, nullptr, 1};
  const DeviceAdamTensor with_copy{&p, &g, &m, &v, &copy, 1};

  DeviceAdamArgs a = base_args();
  a.grad_dtype = DType::kF64;
  Status s = validate_device_adam(a, {&plain, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("grad_dtype = fp64"));

  a = base_args();
  a.moments = cpu_adam::MomentStorage::int8(100);
  s = validate_device_adam(a, {&plain, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("device_adam: moments' block_elements = 100 must be a multiple of 64"));
  EXPECT_EQ(device_adam_reference(a, {&plain, 1}).code(), StatusCode::kInvalidArgument);

  a = base_args();
  a.param_copy_dtype = DType::kF32;
  s = validate_device_adam(a, {&with_copy, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("DeviceAdamTensor[0] has a param_copy but param_copy_dtype = fp32"));
  // The copy dtype only matters where a tensor has a copy.
  EXPECT_TRUE(validate_device_adam(a, {&plain, 1}).ok());
}

TEST(DeviceAdamValidate, NullPointersNameTensorAndField) {
  float p = 0, g = 0, m = 0, v = 0;
  const char* fields[] = {"params", "grads", "exp_avg", "exp_avg_sq"};
  for (int field = 0; field < 4; ++field) {
    DeviceAdamTensor ts[2] = {{&p, &g, &m, &v, nullptr, 1}, {&p, &g, &m, &v, nullptr, 7}};
    if (field == 0) ts[1].params = nullptr;
    if (field == 1) ts[1].grads = nullptr;
    if (field == 2) ts[1].exp_avg = nullptr;
    if (field == 3) ts[1].exp_avg_sq = nullptr;
    const Status s = validate_device_adam(base_args(), ts);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(std::string("DeviceAdamTensor[1].") + fields[field] + " is null but count = 7"));
  }
}

TEST(DeviceAdamValidate, MisalignedPointersNameTensorAndField) {
  // A GPU faults on a misaligned element access; the check names the pointer instead.
  alignas(64) unsigned char buffer[256] = {};
  float* p = reinterpret_cast<float*>(buffer);
  void* g = buffer + 64;
  void* m = buffer + 128;
  void* v = buffer + 192;
  const auto check = [&](DeviceAdamArgs a, DeviceAdamTensor bad, const std::string& expected) {
    const DeviceAdamTensor ts[2] = {{p, g, m, v, nullptr, 1}, bad};
    const Status s = validate_device_adam(a, ts);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << expected;
    EXPECT_THAT(s.message(), HasSubstr(expected));
  };
  check(base_args(), {reinterpret_cast<float*>(buffer + 2), g, m, v, nullptr, 7},
        "DeviceAdamTensor[1].params is not 4-byte aligned (fp32 elements)");
  check(base_args(), {p, buffer + 66, m, v, nullptr, 7}, "DeviceAdamTensor[1].grads is not 4-byte aligned");
  DeviceAdamArgs bf16_grads = base_args();
  bf16_grads.grad_dtype = DType::kBF16;
  check(bf16_grads, {p, buffer + 65, m, v, nullptr, 7}, "DeviceAdamTensor[1].grads is not 2-byte aligned");
  EXPECT_TRUE(validate_device_adam(bf16_grads, std::vector<DeviceAdamTensor>{{p, buffer + 66, m, v, nullptr, 7}}).ok());
  check(base_args(), {p, g, buffer + 130, v, nullptr, 7}, "DeviceAdamTensor[1].exp_avg is not 4-byte aligned");
  DeviceAdamArgs int8 = base_args();
  int8.moments = cpu_adam::MomentStorage::int8();
  check(int8, {p, g, m, buffer + 194, nullptr, 7},
        "DeviceAdamTensor[1].exp_avg_sq is not 4-byte aligned (its block scales are fp32)");
  DeviceAdamArgs bf16_moments = base_args();
  bf16_moments.moments = cpu_adam::MomentStorage::bf16();
  EXPECT_TRUE(
      validate_device_adam(bf16_moments, std::vector<DeviceAdamTensor>{{p, g, buffer + 130, buffer + 194, nullptr, 7}})
          .ok());
  DeviceAdamArgs with_copy = base_args();
  with_copy.param_copy_dtype = DType::kBF16;
  check(with_copy, {p, g, m, v, buffer + 33, 7}, "DeviceAdamTensor[1].param_copy is not 2-byte aligned");
}

TEST(DeviceAdamValidate, ScalarsAndHyperParams) {
  float p = 0, g = 0, m = 0, v = 0;
  const DeviceAdamTensor t{&p, &g, &m, &v, nullptr, 1};
  DeviceAdamArgs a = base_args();
  a.step = 0;
  EXPECT_THAT(validate_device_adam(a, {&t, 1}).message(), HasSubstr("step = 0"));
  a = base_args();
  a.loss_scale = 0.0;
  EXPECT_THAT(validate_device_adam(a, {&t, 1}).message(), HasSubstr("loss_scale"));
  a = base_args();
  a.clip_coefficient = std::nan("");
  EXPECT_THAT(validate_device_adam(a, {&t, 1}).message(), HasSubstr("clip_coefficient"));
  a = base_args();
  a.hyper.beta2 = 1.0;
  const Status s = validate_device_adam(a, {&t, 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("beta2"));
}

TEST(DeviceAdamValidate, EmptyTensorsAreSkippedEvenWithNullPointers) {
  const DeviceAdamTensor empty{};
  EXPECT_TRUE(validate_device_adam(base_args(), {&empty, 1}).ok());
  EXPECT_TRUE(device_adam_reference(base_args(), {&empty, 1}).ok());
  EXPECT_TRUE(device_adam_reference(base_args(), {}).ok());
}

TEST(DeviceAdamStep, NonCudaStreamIsUnsupportedAndSaysWhy) {
  Result<std::unique_ptr<Device>> device = make_device("cpu", {.device_memory_bytes = 1 << 20});
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  Result<std::unique_ptr<Stream>> stream = (*device)->create_stream();
  ASSERT_TRUE(stream.ok()) << stream.status().to_string();
  float p = 0.5f, g = 0.25f, m = 0, v = 0;
  const DeviceAdamTensor t{&p, &g, &m, &v, nullptr, 1};
  const Status s = device_adam_step(**stream, base_args(), {&t, 1});
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_THAT(s.message(), HasSubstr("'cpu'"));
  EXPECT_THAT(s.message(), HasSubstr(device_adam_compiled() ? "cuda streams only" : "no CUDA kernel"));
  EXPECT_EQ(p, 0.5f) << "nothing may run on an unsupported stream";
  // Bad arguments are reported before the stream is looked at.
  DeviceAdamArgs lion = base_args();
  lion.kind = OptimizerKind::kLion;
  EXPECT_THAT(device_adam_step(**stream, lion, {&t, 1}).message(), HasSubstr("'lion'"));
}

TEST(DeviceAdamStep, CompiledMatchesTheBuild) {
#if STRATA_HAVE_CUDA
  EXPECT_TRUE(device_adam_compiled());
#else
  EXPECT_FALSE(device_adam_compiled());
#endif
}

// ---------------------------------------------------------------------------
// The host reference (run everywhere).

// Note [Update formulas] of cpu_adam/src/reference.cpp, transcribed for one
// fp32 element: pins down which decay each kind applies and the fused scaling.
float transcribed_step(OptimizerKind kind, const DeviceAdamArgs& a, float p, float g_raw, float& m, float& v) {
  const cpu_adam::HyperParams& h = a.hyper;
  const double t = static_cast<double>(a.step);
  float g = g_raw * static_cast<float>(a.clip_coefficient / a.loss_scale);
  if (kind == OptimizerKind::kAdam) g = std::fma(static_cast<float>(h.weight_decay), p, g);
  m = std::fma(static_cast<float>(1.0 - h.beta1), g - m, m);
  v = std::fma(static_cast<float>(1.0 - h.beta2) * g, g, v * static_cast<float>(h.beta2));
  const float denom = std::fma(std::sqrt(v), static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, t))),
                               static_cast<float>(h.eps));
  if (kind == OptimizerKind::kAdamW) p = p * static_cast<float>(1.0 - h.lr * h.weight_decay);
  return std::fma(static_cast<float>(-h.lr / (1.0 - std::pow(h.beta1, t))), m / denom, p);
}

TEST(DeviceAdamReference, FollowsTheUpdateFormulas) {
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    DeviceAdamArgs a = base_args();
    a.kind = kind;
    a.hyper.weight_decay = 0.1;
    a.step = 3;
    a.clip_coefficient = 0.5;
    a.loss_scale = 8.0;
    std::vector<float> p = {0.5f, -1.25f, 3.0f}, g = {0.1f, -2.0f, 7.5f}, m = {0.01f, 0.0f, -0.2f},
                       v = {1e-4f, 0.0f, 0.3f};
    std::vector<float> p_ref = p, m_ref = m, v_ref = v;
    for (size_t i = 0; i < p.size(); ++i) p_ref[i] = transcribed_step(kind, a, p[i], g[i], m_ref[i], v_ref[i]);
    const DeviceAdamTensor t{p.data(), g.data(), m.data(), v.data(), nullptr, p.size()};
    ASSERT_TRUE(device_adam_reference(a, {&t, 1}).ok());
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_EQ(std::bit_cast<uint32_t>(p[i]), std::bit_cast<uint32_t>(p_ref[i])) << optimizer_kind_name(kind) << " p[" << i << "]";
      EXPECT_EQ(std::bit_cast<uint32_t>(m[i]), std::bit_cast<uint32_t>(m_ref[i])) << "m[" << i << "]";
      EXPECT_EQ(std::bit_cast<uint32_t>(v[i]), std::bit_cast<uint32_t>(v_ref[i])) << "v[" << i << "]";
    }
  }
}

// The reference over a list equals stepping each tensor on its own with the
// default CpuOptimizer path (bit-identical to scalar by cpu_adam's own claim).
void expect_list_equals_per_tensor_steps(const DeviceAdamArgs& a) {
  std::vector<HostTensor> list, single;
  const size_t sizes[] = {1, 0, 3, 4097};
  for (size_t i = 0; i < 4; ++i) {
    list.push_back(make_tensor(sizes[i], a, i % 2 == 0, 100 + i));
    fill_grads(list.back(), a, 200 + i);
  }
  single = list;
  std::vector<DeviceAdamTensor> views;
  for (HostTensor& t : list) views.push_back(view(t));
  ASSERT_TRUE(device_adam_reference(a, views).ok());

  // Tiles of whole 8-bit blocks (a block may not straddle two tiles).
  const size_t block = a.moments.block_elements();
  const size_t tile = block == 0 ? 65536 : block * (65536 / block);
  Result<cpu_adam::CpuOptimizer> opt =
      cpu_adam::CpuOptimizer::create({.kind = a.kind, .threads = 1, .tile_elements = tile});
  ASSERT_TRUE(opt.ok());
  for (size_t i = 0; i < single.size(); ++i) {
    HostTensor& t = single[i];
    cpu_adam::StateSpans s{.count = t.count, .params = t.params.data(), .grads = t.grads.data(),
                           .grad_dtype = a.grad_dtype,
                           .param_copy = t.param_copy.empty() ? nullptr : t.param_copy.data(),
                           .param_copy_dtype = a.param_copy_dtype};
    a.moments.point(s, t.exp_avg.data(), t.exp_avg_sq.data(), t.count, 0);
    ASSERT_TRUE(opt->step({.step = a.step, .hyper = a.hyper, .loss_scale = a.loss_scale}, s).ok());
    // (A count-0 tensor has no data: memcmp of a null pointer is undefined even for 0 bytes.)
    if (t.count != 0) {
      EXPECT_EQ(0, std::memcmp(t.params.data(), list[i].params.data(), t.count * 4)) << "tensor " << i;
    }
    EXPECT_EQ(t.exp_avg, list[i].exp_avg) << "tensor " << i;
    EXPECT_EQ(t.exp_avg_sq, list[i].exp_avg_sq) << "tensor " << i;
    EXPECT_EQ(t.param_copy, list[i].param_copy) << "tensor " << i;
  }
}

TEST(DeviceAdamReference, ListEqualsPerTensorSteps) {
  DeviceAdamArgs a = base_args();
  a.grad_dtype = DType::kF16;
  a.moments = cpu_adam::MomentStorage::bf16();
  a.param_copy_dtype = DType::kF16;
  a.loss_scale = 1024.0;
  expect_list_equals_per_tensor_steps(a);
}

// 8-bit moments (codes and scales behind them in one buffer per moment), with
// a block size that divides no power of two.
TEST(DeviceAdamReference, Int8ListEqualsPerTensorSteps) {
  for (size_t block : {size_t{64}, size_t{192}, size_t{256}}) {
    DeviceAdamArgs a = base_args();
    a.grad_dtype = DType::kBF16;
    a.moments = cpu_adam::MomentStorage::int8(block);
    expect_list_equals_per_tensor_steps(a);
    if (::testing::Test::HasFailure()) return;
  }
}

// ---------------------------------------------------------------------------
// The CUDA kernel against the reference (GPU only).

// Any cudaGetDeviceCount error (no driver, no device) means "no GPU".
#if STRATA_HAVE_CUDA
#define SKIP_WITHOUT_GPU()                                                                                 \
  do {                                                                                                     \
    int gpus = 0;                                                                                          \
    const cudaError_t err = cudaGetDeviceCount(&gpus);                                                     \
    if (err != cudaSuccess || gpus == 0) {                                                                 \
      cudaGetLastError();                                                                                  \
      GTEST_SKIP() << "no usable GPU: " << (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices"); \
    }                                                                                                      \
  } while (0)
#else
#define SKIP_WITHOUT_GPU() GTEST_SKIP() << "built without CUDA (STRATA_ENABLE_CUDA=OFF or no toolkit)"
#endif

// One tensor's streams in device memory.
struct DeviceTensor {
  DeviceBuffer params, grads, exp_avg, exp_avg_sq, param_copy;
  size_t count = 0;
};

class DeviceAdamGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    Result<std::unique_ptr<Device>> device = make_device("cuda");
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    device_ = std::move(*device);
    Result<std::unique_ptr<Stream>> stream = device_->create_stream();
    ASSERT_TRUE(stream.ok()) << stream.status().to_string();
    stream_ = std::move(*stream);
  }

  DeviceBuffer upload(const void* data, size_t bytes) {
    if (bytes == 0) return {};
    Result<DeviceBuffer> buffer = device_->allocate(bytes);
    EXPECT_TRUE(buffer.ok()) << buffer.status().to_string();
    if (!buffer.ok()) return {};
    EXPECT_TRUE(device_->copy(buffer->data(), data, bytes, CopyKind::kHostToDevice).ok());
    return std::move(*buffer);
  }
  void download(void* data, const DeviceBuffer& buffer, size_t bytes) {
    if (bytes == 0) return;
    ASSERT_TRUE(device_->copy(data, buffer.data(), bytes, CopyKind::kDeviceToHost).ok());
  }

  DeviceTensor to_device(const HostTensor& t) {
    DeviceTensor d;
    d.count = t.count;
    d.params = upload(t.params.data(), t.params.size() * 4);
    d.exp_avg = upload(t.exp_avg.data(), t.exp_avg.size());
    d.exp_avg_sq = upload(t.exp_avg_sq.data(), t.exp_avg_sq.size());
    d.param_copy = upload(t.param_copy.data(), t.param_copy.size());
    return d;
  }

  // Runs `steps` steps of `a` on the device and on the host reference from
  // the same start and compares every stream of every tensor bit for bit.
  void check(DeviceAdamArgs a, const std::vector<size_t>& sizes, bool copies, int steps, uint32_t seed) {
    std::vector<HostTensor> host;
    for (size_t i = 0; i < sizes.size(); ++i) host.push_back(make_tensor(sizes[i], a, copies && i % 2 == 0, seed + i));
    std::vector<DeviceTensor> dev;
    for (const HostTensor& t : host) dev.push_back(to_device(t));
    for (int step = 1; step <= steps; ++step) {
      a.step = step;
      a.hyper.lr = 1e-3 * (1.0 + 0.25 * step);  // a schedule changes lr between steps
      a.clip_coefficient = step == 2 ? 0.375 : 1.0;
      std::vector<DeviceAdamTensor> host_views, dev_views;
      for (size_t i = 0; i < host.size(); ++i) {
        fill_grads(host[i], a, seed * 7919 + step * 131 + static_cast<uint32_t>(i));
        dev[i].grads = upload(host[i].grads.data(), host[i].grads.size());
        host_views.push_back(view(host[i]));
        dev_views.push_back({dev[i].params.as<float>(), dev[i].grads.data(), dev[i].exp_avg.data(),
                             dev[i].exp_avg_sq.data(), dev[i].param_copy.data(), dev[i].count});
      }
      ASSERT_TRUE(device_adam_step(*stream_, a, dev_views).ok());
      ASSERT_TRUE(stream_->synchronize().ok());
      ASSERT_TRUE(device_adam_reference(a, host_views).ok());
    }
    for (size_t i = 0; i < host.size(); ++i) {
      const HostTensor& h = host[i];
      HostTensor got = h;
      download(got.params.data(), dev[i].params, h.params.size() * 4);
      download(got.exp_avg.data(), dev[i].exp_avg, h.exp_avg.size());
      download(got.exp_avg_sq.data(), dev[i].exp_avg_sq, h.exp_avg_sq.size());
      download(got.param_copy.data(), dev[i].param_copy, h.param_copy.size());
      const std::string what = "tensor " + std::to_string(i) + " (" + std::to_string(h.count) + " elements, grads " +
                               std::string(dtype_name(a.grad_dtype)) + ", moments " +
                               std::string(a.moments.name()) + ", kind " +
                               std::string(optimizer_kind_name(a.kind)) + ")";
      expect_same_bits(got.params.data(), h.params.data(), h.params.size() * 4, 4, what + " params");
      // 8-bit moments: byte by byte over the codes, the padding and the scales.
      const size_t moment_elem = a.moments.blocked() ? 1 : dtype_size(a.moments.element_dtype());
      expect_same_bits(got.exp_avg.data(), h.exp_avg.data(), h.exp_avg.size(), moment_elem, what + " exp_avg");
      expect_same_bits(got.exp_avg_sq.data(), h.exp_avg_sq.data(), h.exp_avg_sq.size(), moment_elem,
                       what + " exp_avg_sq");
      expect_same_bits(got.param_copy.data(), h.param_copy.data(), h.param_copy.size(), 2, what + " param_copy");
    }
  }

  static void expect_same_bits(const void* got, const void* want, size_t bytes, size_t elem, const std::string& what) {
    const auto* a = static_cast<const unsigned char*>(got);
    const auto* b = static_cast<const unsigned char*>(want);
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < bytes; i += elem) {
      if (std::memcmp(a + i, b + i, elem) != 0 && wrong++ == 0) first = i / elem;
    }
    EXPECT_EQ(wrong, 0u) << what << ": " << wrong << " elements differ, first at " << first;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

const std::vector<size_t> kOddSizes = {1, 3, 0, 4097, (size_t{1} << 20) + 5, 16384, 16385};

TEST_F(DeviceAdamGpu, EveryDtypeMixBitIdenticalToReference) {
  uint32_t seed = 1;
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (cpu_adam::MomentStorage moments : {cpu_adam::MomentStorage::fp32(), cpu_adam::MomentStorage::bf16()}) {
        for (DType copy : {DType::kBF16, DType::kF16}) {
          DeviceAdamArgs a = base_args();
          a.kind = kind;
          a.grad_dtype = grad;
          a.moments = moments;
          a.param_copy_dtype = copy;
          a.loss_scale = grad == DType::kF16 ? 1024.0 : 1.0;
          check(a, kOddSizes, /*copies=*/true, /*steps=*/3, seed++);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// 8-bit moments: every grad dtype and copy, Adam and AdamW, block sizes from
// 64 to 4096 (192 divides no chunk of a power-of-two size), odd sizes that
// leave partial blocks, three steps with clipping on one.
TEST_F(DeviceAdamGpu, Int8MomentsBitIdenticalToReference) {
  uint32_t seed = 500;
  for (size_t block : {size_t{64}, size_t{192}, size_t{256}, size_t{4096}}) {
    for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
      for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (DType copy : {DType::kBF16, DType::kF16}) {
          DeviceAdamArgs a = base_args();
          a.kind = kind;
          a.grad_dtype = grad;
          a.moments = cpu_adam::MomentStorage::int8(block);
          a.param_copy_dtype = copy;
          a.loss_scale = grad == DType::kF16 ? 1024.0 : 1.0;
          check(a, kOddSizes, /*copies=*/true, /*steps=*/3, seed++);
          if (HasFatalFailure() || HasFailure()) return;
        }
      }
    }
  }
}

TEST_F(DeviceAdamGpu, WithoutCopiesAndWithoutDecayOrBiasCorrection) {
  DeviceAdamArgs a = base_args();
  a.hyper.weight_decay = 0.0;
  check(a, kOddSizes, /*copies=*/false, 2, 77);
  a.kind = OptimizerKind::kAdam;
  a.hyper.bias_correction = false;
  check(a, {5, 70000}, /*copies=*/false, 2, 78);
}

TEST_F(DeviceAdamGpu, EmptyListLaunchesNothing) {
  const DeviceAdamTensor empty{};
  EXPECT_TRUE(device_adam_step(*stream_, base_args(), {}).ok());
  EXPECT_TRUE(device_adam_step(*stream_, base_args(), {&empty, 1}).ok());
  EXPECT_TRUE(stream_->synchronize().ok());
}

}  // namespace
}  // namespace strata::offload
