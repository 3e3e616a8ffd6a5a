#pragma once
// Test helper: one optimizer state of a given dtype mix in owned buffers,
// filled from a seed, with a configurable misalignment of every span.
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::cpu_adam::testing {

struct Mix {
  OptimizerKind kind = OptimizerKind::kAdamW;
  DType grad = DType::kF32;
  DType moment = DType::kF32;
  bool copy = false;
  DType copy_dtype = DType::kBF16;
};

inline std::string mix_name(const Mix& m) {
  return std::string(optimizer_kind_name(m.kind)) + "_g" + std::string(dtype_name(m.grad)) + "_m" +
         std::string(dtype_name(m.moment)) + "_c" + (m.copy ? std::string(dtype_name(m.copy_dtype)) : "none");
}

inline std::vector<Mix> all_mixes() {
  std::vector<Mix> out;
  for (OptimizerKind k : {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kAdagrad, OptimizerKind::kLion})
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
      for (DType m : {DType::kF32, DType::kBF16})
        for (int c = 0; c < 3; ++c)
          out.push_back(Mix{k, g, m, c != 0, c == 2 ? DType::kF16 : DType::kBF16});
  return out;
}

inline void store_as(DType t, void* base, size_t i, float x) {
  if (t == DType::kF32) static_cast<float*>(base)[i] = x;
  if (t == DType::kBF16) static_cast<uint16_t*>(base)[i] = fp32_to_bf16_bits(x);
  if (t == DType::kF16) static_cast<uint16_t*>(base)[i] = fp32_to_fp16_bits(x);
}
inline float load_as(DType t, const void* base, size_t i) {
  if (t == DType::kF32) return static_cast<const float*>(base)[i];
  if (t == DType::kBF16) return bf16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
  return fp16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
}

// Buffers are byte vectors; each span starts `misalign` elements past the
// start of its buffer, so 1 gives starts that are not 8- or 16-lane aligned.
class TestState {
 public:
  TestState(const Mix& mix, size_t count, size_t misalign = 0) : mix_(mix), count_(count), off_(misalign) {
    params_.assign((count + off_) * 4, 0);
    grads_.assign((count + off_) * dtype_size(mix.grad), 0);
    m_.assign((count + off_) * dtype_size(mix.moment), 0);
    v_.assign((count + off_) * dtype_size(mix.moment), 0);
    copy_.assign((count + off_) * 2, 0);
  }

  // Params ~ N(0, 1), moments from a previous-looking state (v >= 0), grads ~ N(0, grad_sigma).
  void fill(uint32_t seed, float grad_sigma = 0.1f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < count_; ++i) {
      params()[i] = normal(rng);
      store_as(mix_.moment, m(), i, 0.01f * normal(rng));
      const float s = 0.01f * normal(rng);
      store_as(mix_.moment, v(), i, s * s);
    }
    fill_grads(seed + 1, grad_sigma);
  }
  void fill_grads(uint32_t seed, float sigma) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, sigma);
    for (size_t i = 0; i < count_; ++i) store_as(mix_.grad, grads(), i, normal(rng));
  }
  void set_grad(size_t i, float x) { store_as(mix_.grad, grads(), i, x); }

  StateSpans spans() {
    StateSpans s;
    s.count = count_;
    s.params = params();
    s.grads = grads();
    s.grad_dtype = mix_.grad;
    s.exp_avg = mix_.kind == OptimizerKind::kAdagrad ? nullptr : m();
    s.exp_avg_sq = mix_.kind == OptimizerKind::kLion ? nullptr : v();
    s.moment_dtype = mix_.moment;
    s.param_copy = mix_.copy ? copy() : nullptr;
    s.param_copy_dtype = mix_.copy_dtype;
    return s;
  }

  float* params() { return reinterpret_cast<float*>(params_.data()) + off_; }
  void* grads() { return grads_.data() + off_ * dtype_size(mix_.grad); }
  void* m() { return m_.data() + off_ * dtype_size(mix_.moment); }
  void* v() { return v_.data() + off_ * dtype_size(mix_.moment); }
  void* copy() { return copy_.data() + off_ * 2; }
  const Mix& mix() const { return mix_; }
  size_t count() const { return count_; }

  // Byte images of every buffer, for bit-identity checks.
  std::vector<std::vector<uint8_t>> snapshot() const { return {params_, grads_, m_, v_, copy_}; }

 private:
  Mix mix_;
  size_t count_;
  size_t off_;
  std::vector<uint8_t> params_, grads_, m_, v_, copy_;
};

inline CpuOptimizer make_optimizer(OptimizerKind kind, KernelPath path, int threads = 1, size_t tile = 65536) {
  auto opt = CpuOptimizer::create({.kind = kind, .threads = threads, .tile_elements = tile, .path = path});
  if (!opt.ok()) throw std::runtime_error(opt.status().to_string());
  return std::move(opt).value();
}

}  // namespace strata::cpu_adam::testing
