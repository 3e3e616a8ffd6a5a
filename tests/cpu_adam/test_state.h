#pragma once
// Test helper: one optimizer state of a given dtype mix in owned buffers,
// filled from a seed, with a configurable misalignment of every span.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <random>
#include <stdexcept>
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
  bool int8 = false;        // MomentFormat::kBlockInt8 (moment is then ignored)
  size_t block = 64;        // moment_block_elements with int8
};

inline std::string mix_name(const Mix& m) {
  return std::string(optimizer_kind_name(m.kind)) + "_g" + std::string(dtype_name(m.grad)) + "_m" +
         (m.int8 ? "int8b" + std::to_string(m.block) : std::string(dtype_name(m.moment))) + "_c" +
         (m.copy ? std::string(dtype_name(m.copy_dtype)) : "none");
}

inline std::vector<Mix> all_mixes() {
  std::vector<Mix> out;
  for (OptimizerKind k : {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kAdagrad, OptimizerKind::kLion})
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
      for (DType m : {DType::kF32, DType::kBF16})
        for (int c = 0; c < 3; ++c)
          out.push_back(Mix{k, g, m, c != 0, c == 2 ? DType::kF16 : DType::kBF16});
  // 8-bit moments: Adam and AdamW only.
  for (OptimizerKind k : {OptimizerKind::kAdam, OptimizerKind::kAdamW})
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
      for (int c = 0; c < 3; ++c)
        out.push_back(Mix{k, g, DType::kF32, c != 0, c == 2 ? DType::kF16 : DType::kBF16, true, 64});
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
// Buffers on 64-byte boundaries, so that misalign 0 is aligned for every
// vector width (the non-temporal stores' condition) and misalign 1 or 3 is not.
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
using AlignedBytes = std::vector<uint8_t, Aligned64<uint8_t>>;

class TestState {
 public:
  TestState(const Mix& mix, size_t count, size_t misalign = 0) : mix_(mix), count_(count), off_(misalign) {
    params_.assign((count + off_) * 4, 0);
    grads_.assign((count + off_) * dtype_size(mix.grad), 0);
    m_.assign((count + off_) * moment_bytes(), 0);
    v_.assign((count + off_) * moment_bytes(), 0);
    copy_.assign((count + off_) * 2, 0);
    const size_t blocks = mix.int8 ? moment_block_count(count, mix.block) : 0;
    m_scale_.assign(blocks * 4, 0);
    v_scale_.assign(blocks * 4, 0);
  }

  // Params ~ N(0, 1), moments from a previous-looking state (v >= 0), grads ~ N(0, grad_sigma).
  void fill(uint32_t seed, float grad_sigma = 0.1f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> m_values(count_), v_values(count_);
    for (size_t i = 0; i < count_; ++i) {
      params()[i] = normal(rng);
      m_values[i] = 0.01f * normal(rng);
      const float s = 0.01f * normal(rng);
      v_values[i] = s * s;
      if (!mix_.int8) {
        store_as(mix_.moment, m(), i, m_values[i]);
        store_as(mix_.moment, v(), i, v_values[i]);
      }
    }
    if (mix_.int8) {
      if (!quantize_moments(Int8Moment::kExpAvg, m_values.data(), count_, mix_.block, static_cast<uint8_t*>(m()),
                            m_scales()).ok() ||
          !quantize_moments(Int8Moment::kExpAvgSq, v_values.data(), count_, mix_.block, static_cast<uint8_t*>(v()),
                            v_scales()).ok())
        throw std::runtime_error("TestState::fill: quantize_moments failed");
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
    if (mix_.int8) {
      s.moment_format = MomentFormat::kBlockInt8;
      s.exp_avg_scale = s.exp_avg != nullptr ? m_scales() : nullptr;
      s.exp_avg_sq_scale = s.exp_avg_sq != nullptr ? v_scales() : nullptr;
      s.moment_block_elements = mix_.block;
    }
    return s;
  }

  float* params() { return reinterpret_cast<float*>(params_.data()) + off_; }
  void* grads() { return grads_.data() + off_ * dtype_size(mix_.grad); }
  void* m() { return m_.data() + off_ * moment_bytes(); }
  void* v() { return v_.data() + off_ * moment_bytes(); }
  float* m_scales() { return reinterpret_cast<float*>(m_scale_.data()); }
  float* v_scales() { return reinterpret_cast<float*>(v_scale_.data()); }
  size_t moment_bytes() const { return mix_.int8 ? 1 : dtype_size(mix_.moment); }
  void* copy() { return copy_.data() + off_ * 2; }
  const Mix& mix() const { return mix_; }
  size_t count() const { return count_; }

  // Whether `address` lies in one of the state's buffers (not, say, a kernel's stack).
  bool owns(const void* address) const {
    const auto* a = static_cast<const uint8_t*>(address);
    for (const auto* buffer : {&params_, &grads_, &m_, &v_, &copy_, &m_scale_, &v_scale_})
      if (!buffer->empty() && a >= buffer->data() && a < buffer->data() + buffer->size()) return true;
    return false;
  }

  // Byte images of every buffer, for bit-identity checks: params, grads, m,
  // v, copy, then the 8-bit moments' scales (m, v; empty otherwise).
  std::vector<std::vector<uint8_t>> snapshot() const {
    std::vector<std::vector<uint8_t>> out;
    for (const AlignedBytes* b : {&params_, &grads_, &m_, &v_, &copy_, &m_scale_, &v_scale_})
      out.emplace_back(b->begin(), b->end());
    return out;
  }

 private:
  Mix mix_;
  size_t count_;
  size_t off_;
  AlignedBytes params_, grads_, m_, v_, copy_, m_scale_, v_scale_;
};

inline CpuOptimizer make_optimizer(OptimizerKind kind, KernelPath path, int threads = 1, size_t tile = 65536) {
  auto opt = CpuOptimizer::create({.kind = kind, .threads = threads, .tile_elements = tile, .path = path});
  if (!opt.ok()) throw std::runtime_error(opt.status().to_string());
  return std::move(opt).value();
}

}  // namespace strata::cpu_adam::testing
