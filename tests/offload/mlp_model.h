#pragma once
// A second model for the engine that a caller drives (issue 22 §2), one that
// is not the GPT: a small MLP on synthetic data, described from outside by
// tensor specs (SpecModel), whose forward and backward run on the host in
// plain loops against any ParameterProvider, beside a plain-loop fp32
// reference trainer (AdamW, global-norm clipping, per-tensor weight decay
// and lr scale) that the engine's losses and parameters are compared with.
//
// Note [The MLP]
//   x in R^D (uniform in [-1, 1)), y in [0, C): the argmax of a fixed random
//   teacher T x. C == D, which the tied weight below needs.
//   layer 0 "embed_in": W0 [H, D], b0 [H] (no decay)   h0 = tanh(W0 x + b0)
//   layer 1 "frozen":   W1 [H, H] (not trainable)      h1 = h0 + tanh(W1 h0)
//   layer 2 "cond":     W2 [H, H], odd steps only      h2 = h1 + tanh(W2 h1)   (even steps: h2 = h1)
//   layer 3 "head":     Wh [C, H] (lr scale 0.5)       logits = Wh h2 + W0^T h2  (W0 tied: layer 0 again)
//   loss = the batch's mean softmax cross-entropy.
// On even steps layer 2 is not acquired at all: its gradient is zero, and
// AdamW still moves it (momentum, decay), in the engine as in the reference.
//
// Note [The MLP's acquire sequence]
// One training micro-batch, in the natural order (Note [Acquire and
// release] in strata/core/layered_model.h):
//   forward   0, 1, [2], 3, 0 (nested inside 3: the tie)
//   backward  3, 0 (nested inside 3: the tie's gradient first), [2], 1, 0
// The frozen layer is acquired for backward too (its parameters carry the
// gradient back to layer 0) and gets no gradient buffer. Other orders
// (MlpOrder) visit the layers differently and compute the same numbers, so
// any order gives bit-identical gradients and losses:
//   kSwapForward   forward 1, 0 (0 nested inside 1), [2], 3, 0
//   kSwapBackward  backward 3, 0, [2], 0, 1 (1 nested inside the encoder's 0)
//   kRecompute     backward re-runs layer 2's forward before its backward
//                  (activation checkpointing: acquire(2, kForward) in backward)
// Every layer's gradient contributions are added in the same order in each
// of them (the tie's into layer 0 before the encoder's).
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/completion.h"
#include "strata/core/dtype.h"
#include "strata/core/layered_model.h"
#include "strata/core/spec_model.h"
#include "strata/core/status.h"

namespace strata::mlp {

// Big enough that every layer spans more than one kShardAlign (2048-element)
// piece at world size 2, so each rank owns a real part of each layer.
inline constexpr int kD = 32;  // input features
inline constexpr int kH = 96;  // hidden width
inline constexpr int kC = 32;  // classes
static_assert(kC == kD, "the tied head reads W0 [H, D] as a [C, H] matrix transposed");

enum LayerIndex : size_t { kEmbedIn = 0, kFrozen = 1, kCond = 2, kHead = 3, kLayerCount = 4 };

inline constexpr double kHeadLrScale = 0.5;

// Whether the conditional layer runs in (1-based) step `step`.
inline bool cond_used(int64_t step) { return step % 2 == 1; }

// ---------------------------------------------------------------- numbers

// splitmix64: a seeded, platform-independent generator.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi), from the top 24 bits (exact in float).
  float uniform(float lo, float hi) {
    const float u = static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
    return lo + (hi - lo) * u;
  }

 private:
  uint64_t state_;
};

inline uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  Rng r(seed ^ (a * 0x100000001B3ull) ^ (b * 0xC2B2AE3D27D4EB4Full) ^ (c * 0x165667B19E3779F9ull));
  return r.next();
}

struct Batch {
  int size = 0;
  std::vector<float> x;  // [size, D]
  std::vector<int> y;    // [size]
};

inline Batch make_batch_from(uint64_t batch_seed, uint64_t data_seed, int size) {
  // The teacher: fixed per data seed.
  Rng t(data_seed ^ 0x7EAC4E5ull);
  std::vector<float> teacher(static_cast<size_t>(kC) * kD);
  for (float& v : teacher) v = t.uniform(-1.0f, 1.0f);
  Batch b;
  b.size = size;
  b.x.resize(static_cast<size_t>(size) * kD);
  b.y.resize(static_cast<size_t>(size));
  Rng r(batch_seed);
  for (float& v : b.x) v = r.uniform(-1.0f, 1.0f);
  for (int n = 0; n < size; ++n) {
    int best = 0;
    float best_v = -1e30f;
    for (int c = 0; c < kC; ++c) {
      float s = 0;
      for (int i = 0; i < kD; ++i) s += teacher[static_cast<size_t>(c) * kD + i] * b.x[static_cast<size_t>(n) * kD + i];
      if (s > best_v) {
        best_v = s;
        best = c;
      }
    }
    b.y[static_cast<size_t>(n)] = best;
  }
  return b;
}

// Training batch of (1-based) step `step`, micro-batch `micro`, rank `rank`.
inline Batch make_batch(uint64_t data_seed, int64_t step, int micro, int rank, int size) {
  return make_batch_from(mix_seed(data_seed, static_cast<uint64_t>(step), static_cast<uint64_t>(micro) + 1,
                                  static_cast<uint64_t>(rank) + 1),
                         data_seed, size);
}
// Evaluation batch `index` (disjoint from the training batches' seeds).
inline Batch make_eval_batch(uint64_t data_seed, int index, int size) {
  return make_batch_from(mix_seed(data_seed ^ 0xE7A1ull, 0, static_cast<uint64_t>(index) + 1, 0), data_seed, size);
}

// ---------------------------------------------------------------- the model's description

struct MlpSpecOptions {
  DType dtype = DType::kF32;
  // The per-tensor hyper-parameters; off: every tensor takes the optimizer's
  // (the control run that shows they matter).
  bool bias_no_decay = true;
  bool head_lr_scale = true;
};

// A tensor description with every field given (no aggregate with missing initializers).
inline TensorDescription tensor(std::string name, std::vector<int64_t> shape, DType dtype, bool trainable = true,
                                std::optional<double> weight_decay = std::nullopt, double lr_scale = 1.0) {
  TensorDescription t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = dtype;
  t.trainable = trainable;
  t.weight_decay = weight_decay;
  t.lr_scale = lr_scale;
  return t;
}

inline std::vector<LayerDescription> layer_descriptions(const MlpSpecOptions& o = {}) {
  std::optional<double> bias_decay;
  if (o.bias_no_decay) bias_decay = 0.0;
  const double head_scale = o.head_lr_scale ? kHeadLrScale : 1.0;
  return {
      {"embed_in",
       {tensor("embed_in.weight", {kH, kD}, o.dtype), tensor("embed_in.bias", {kH}, o.dtype, true, bias_decay)}},
      {"frozen", {tensor("frozen.weight", {kH, kH}, o.dtype, /*trainable=*/false)}},
      {"cond", {tensor("cond.weight", {kH, kH}, o.dtype)}},
      {"head", {tensor("head.weight", {kC, kH}, o.dtype, true, std::nullopt, head_scale)}},
  };
}

// Elements of each layer, in the flat layout of layer_descriptions().
inline constexpr size_t kW0 = static_cast<size_t>(kH) * kD, kB0 = kH, kW1 = static_cast<size_t>(kH) * kH,
                        kW2 = static_cast<size_t>(kH) * kH, kWh = static_cast<size_t>(kC) * kH;
inline constexpr size_t layer_elements(size_t li) {
  return li == kEmbedIn ? kW0 + kB0 : li == kFrozen ? kW1 : li == kCond ? kW2 : kWh;
}

// Deterministic initial values, fp32, one flat vector per layer.
inline std::vector<std::vector<float>> initial_values(uint64_t seed) {
  std::vector<std::vector<float>> v(kLayerCount);
  Rng r(seed);
  const float a0 = 1.0f / std::sqrt(static_cast<float>(kD)), ah = 1.0f / std::sqrt(static_cast<float>(kH));
  v[kEmbedIn].resize(kW0 + kB0);
  for (size_t i = 0; i < kW0; ++i) v[kEmbedIn][i] = r.uniform(-a0, a0);
  for (size_t i = 0; i < kB0; ++i) v[kEmbedIn][kW0 + i] = r.uniform(-0.5f, 0.5f);
  v[kFrozen].resize(kW1);
  for (float& x : v[kFrozen]) x = r.uniform(-1.5f * ah, 1.5f * ah);
  v[kCond].resize(kW2);
  for (float& x : v[kCond]) x = r.uniform(-ah, ah);
  v[kHead].resize(kWh);
  for (float& x : v[kHead]) x = r.uniform(-ah, ah);
  return v;
}

// fp32 values -> the layer's bytes in `dtype` (round to nearest even).
inline std::vector<std::byte> to_bytes(std::span<const float> values, DType dtype) {
  std::vector<std::byte> out(values.size() * dtype_size(dtype));
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

inline float load_element(const std::byte* base, DType dtype, size_t i) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, base + 4 * i, 4);
    return f;
  }
  uint16_t bits;
  std::memcpy(&bits, base + 2 * i, 2);
  return dtype == DType::kBF16 ? bf16_bits_to_fp32(bits) : fp16_bits_to_fp32(bits);
}

inline std::vector<float> to_floats(const std::byte* base, DType dtype, size_t count) {
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = load_element(base, dtype, i);
  return out;
}

// ---------------------------------------------------------------- the math (plain loops)
// Templated on the scalar so that a finite-difference check can run the
// same code in double; the model and the reference run it in float.

template <typename T>
struct Weights {
  const T* w0 = nullptr;  // [H, D]
  const T* b0 = nullptr;  // [H]
  const T* w1 = nullptr;  // [H, H]
  const T* w2 = nullptr;  // [H, H], only when the conditional layer runs
  const T* wh = nullptr;  // [C, H]
};

template <typename T>
struct Activations {
  std::vector<T> h0, u1, h1, u2, h2, probs;  // [B, H] each; probs [B, C]
};

// h0 = tanh(W0 x + b0)
template <typename T>
void embed_forward(const T* w0, const T* b0, const Batch& b, std::vector<T>& h0) {
  h0.assign(static_cast<size_t>(b.size) * kH, T(0));
  for (int n = 0; n < b.size; ++n)
    for (int j = 0; j < kH; ++j) {
      T s = b0[j];
      for (int i = 0; i < kD; ++i) s += w0[j * kD + i] * static_cast<T>(b.x[static_cast<size_t>(n) * kD + i]);
      h0[static_cast<size_t>(n) * kH + j] = std::tanh(s);
    }
}

// out = in + tanh(W in); u = tanh(W in)
template <typename T>
void residual_forward(const T* w, int batch, const std::vector<T>& in, std::vector<T>& u, std::vector<T>& out) {
  u.assign(in.size(), T(0));
  out.assign(in.size(), T(0));
  for (int n = 0; n < batch; ++n)
    for (int j = 0; j < kH; ++j) {
      T s = 0;
      for (int k = 0; k < kH; ++k) s += w[j * kH + k] * in[static_cast<size_t>(n) * kH + k];
      const T t = std::tanh(s);
      u[static_cast<size_t>(n) * kH + j] = t;
      out[static_cast<size_t>(n) * kH + j] = in[static_cast<size_t>(n) * kH + j] + t;
    }
}

// logits = Wh h2 + W0^T h2, probs = softmax(logits); returns the mean
// cross-entropy (in double).
template <typename T>
double head_forward(const T* wh, const T* w0, const Batch& b, const std::vector<T>& h2, std::vector<T>& probs) {
  probs.assign(static_cast<size_t>(b.size) * kC, T(0));
  double loss = 0;
  for (int n = 0; n < b.size; ++n) {
    T logits[kC];
    for (int c = 0; c < kC; ++c) {
      T s = 0;
      for (int j = 0; j < kH; ++j) s += wh[c * kH + j] * h2[static_cast<size_t>(n) * kH + j];
      T t = 0;
      for (int j = 0; j < kH; ++j) t += w0[j * kD + c] * h2[static_cast<size_t>(n) * kH + j];
      logits[c] = s + t;
    }
    double mx = logits[0];
    for (int c = 1; c < kC; ++c) mx = std::max(mx, static_cast<double>(logits[c]));
    double sum = 0;
    for (int c = 0; c < kC; ++c) sum += std::exp(static_cast<double>(logits[c]) - mx);
    for (int c = 0; c < kC; ++c)
      probs[static_cast<size_t>(n) * kC + c] = static_cast<T>(std::exp(static_cast<double>(logits[c]) - mx) / sum);
    loss += (std::log(sum) + mx) - static_cast<double>(logits[b.y[static_cast<size_t>(n)]]);
  }
  return loss / b.size;
}

// The whole forward on resident weights (the reference, the gradient check).
template <typename T>
double forward(const Weights<T>& w, const Batch& b, bool cond, Activations<T>& a) {
  embed_forward(w.w0, w.b0, b, a.h0);
  residual_forward(w.w1, b.size, a.h0, a.u1, a.h1);
  if (cond) {
    residual_forward(w.w2, b.size, a.h1, a.u2, a.h2);
  } else {
    a.u2.clear();
    a.h2 = a.h1;
  }
  return head_forward(w.wh, w.w0, b, a.h2, a.probs);
}

// d(loss * grad_scale)/d(logits) = (probs - onehot) * grad_scale / B.
// Contributions (fresh, not accumulated): d_wh [C, H], d_w0_tie [H, D]; dh2 [B, H].
template <typename T>
void head_backward(const T* wh, const T* w0, const Batch& b, const Activations<T>& a, double grad_scale, T* d_wh,
                   T* d_w0_tie, std::vector<T>& dh2) {
  const T coef = static_cast<T>(grad_scale / b.size);
  std::vector<T> dl(static_cast<size_t>(b.size) * kC);
  for (int n = 0; n < b.size; ++n)
    for (int c = 0; c < kC; ++c) {
      const T onehot = c == b.y[static_cast<size_t>(n)] ? T(1) : T(0);
      dl[static_cast<size_t>(n) * kC + c] = (a.probs[static_cast<size_t>(n) * kC + c] - onehot) * coef;
    }
  std::fill(d_wh, d_wh + kWh, T(0));
  std::fill(d_w0_tie, d_w0_tie + kW0, T(0));
  for (int c = 0; c < kC; ++c)
    for (int j = 0; j < kH; ++j) {
      T s = 0;
      for (int n = 0; n < b.size; ++n) s += dl[static_cast<size_t>(n) * kC + c] * a.h2[static_cast<size_t>(n) * kH + j];
      d_wh[c * kH + j] = s;
      d_w0_tie[j * kD + c] = s;  // the same product: logits_c += W0[j, c] h2_j
    }
  dh2.assign(static_cast<size_t>(b.size) * kH, T(0));
  for (int n = 0; n < b.size; ++n)
    for (int j = 0; j < kH; ++j) {
      T s = 0;
      for (int c = 0; c < kC; ++c) s += (wh[c * kH + j] + w0[j * kD + c]) * dl[static_cast<size_t>(n) * kC + c];
      dh2[static_cast<size_t>(n) * kH + j] = s;
    }
}

// out = in + tanh(W in): given d out, d W (when d_w is not null) and d in.
template <typename T>
void residual_backward(const T* w, int batch, const std::vector<T>& in, const std::vector<T>& u,
                       const std::vector<T>& dout, T* d_w, std::vector<T>& din) {
  std::vector<T> dz(dout.size());
  for (size_t i = 0; i < dout.size(); ++i) dz[i] = dout[i] * (T(1) - u[i] * u[i]);
  if (d_w != nullptr)
    for (int j = 0; j < kH; ++j)
      for (int k = 0; k < kH; ++k) {
        T s = 0;
        for (int n = 0; n < batch; ++n) s += dz[static_cast<size_t>(n) * kH + j] * in[static_cast<size_t>(n) * kH + k];
        d_w[j * kH + k] = s;
      }
  din.assign(dout.size(), T(0));
  for (int n = 0; n < batch; ++n)
    for (int k = 0; k < kH; ++k) {
      T s = 0;
      for (int j = 0; j < kH; ++j) s += w[j * kH + k] * dz[static_cast<size_t>(n) * kH + j];
      din[static_cast<size_t>(n) * kH + k] = dout[static_cast<size_t>(n) * kH + k] + s;
    }
}

// h0 = tanh(W0 x + b0): d W0 (the encoder's contribution) and d b0.
template <typename T>
void embed_backward(const Batch& b, const Activations<T>& a, const std::vector<T>& dh0, T* d_w0, T* d_b0) {
  std::vector<T> dz(dh0.size());
  for (size_t i = 0; i < dh0.size(); ++i) dz[i] = dh0[i] * (T(1) - a.h0[i] * a.h0[i]);
  for (int j = 0; j < kH; ++j) {
    for (int i = 0; i < kD; ++i) {
      T s = 0;
      for (int n = 0; n < b.size; ++n)
        s += dz[static_cast<size_t>(n) * kH + j] * static_cast<T>(b.x[static_cast<size_t>(n) * kD + i]);
      d_w0[j * kD + i] = s;
    }
    T s = 0;
    for (int n = 0; n < b.size; ++n) s += dz[static_cast<size_t>(n) * kH + j];
    d_b0[j] = s;
  }
}

// Per-layer gradient contributions of one micro-batch, in the order they
// are added (Note [The MLP's acquire sequence]).
template <typename T>
struct Contributions {
  std::vector<T> wh, w0_tie, w2, w0_enc, b0;  // w2 empty when the conditional layer did not run
};

template <typename T>
Contributions<T> backward(const Weights<T>& w, const Batch& b, bool cond, const Activations<T>& a, double grad_scale) {
  Contributions<T> g;
  g.wh.resize(kWh);
  g.w0_tie.resize(kW0);
  std::vector<T> dh2, dh1, dh0;
  head_backward(w.wh, w.w0, b, a, grad_scale, g.wh.data(), g.w0_tie.data(), dh2);
  if (cond) {
    g.w2.resize(kW2);
    residual_backward(w.w2, b.size, a.h1, a.u2, dh2, g.w2.data(), dh1);
  } else {
    dh1 = dh2;
  }
  residual_backward<T>(w.w1, b.size, a.h0, a.u1, dh1, nullptr, dh0);
  g.w0_enc.resize(kW0);
  g.b0.resize(kB0);
  embed_backward(b, a, dh0, g.w0_enc.data(), g.b0.data());
  return g;
}

// ---------------------------------------------------------------- the model against a provider

enum class MlpOrder : uint8_t { kNatural, kSwapForward, kSwapBackward, kRecompute };

inline const char* order_name(MlpOrder o) {
  switch (o) {
    case MlpOrder::kNatural:
      return "natural";
    case MlpOrder::kSwapForward:
      return "swap-forward";
    case MlpOrder::kSwapBackward:
      return "swap-backward";
    case MlpOrder::kRecompute:
      return "recompute";
  }
  return "?";
}

// Runs the MLP's passes on the host against a ParameterProvider (the
// engine): acquire, wait for ready, read the parameters in their declared
// dtype, accumulate the gradient contributions (fp32 sum, rounded once per
// acquire to the buffer's dtype), release with a complete Completion (the
// work ran synchronously).
class MlpModel {
 public:
  explicit MlpModel(std::span<const LayerSpec> layers) : layers_(layers.begin(), layers.end()) {}

  // One training micro-batch of step `step` (the conditional layer runs on
  // odd steps); the loss's gradient is scaled by `grad_scale`. Returns the
  // micro-batch's mean loss.
  Result<double> train_micro_batch(ParameterProvider& p, const Batch& b, bool cond, double grad_scale,
                                   MlpOrder order = MlpOrder::kNatural) {
    Activations<float> a;
    // ---- forward
    if (order == MlpOrder::kSwapForward) {
      STRATA_ASSIGN_OR_RETURN(Held l1, take(p, kFrozen, Pass::kForward));
      STRATA_ASSIGN_OR_RETURN(Held l0, take(p, kEmbedIn, Pass::kForward));
      embed_forward(l0.values.data(), l0.values.data() + kW0, b, a.h0);
      residual_forward(l1.values.data(), b.size, a.h0, a.u1, a.h1);
      STRATA_RETURN_IF_ERROR(give(p, l0));
      STRATA_RETURN_IF_ERROR(give(p, l1));
    } else {
      STRATA_ASSIGN_OR_RETURN(Held l0, take(p, kEmbedIn, Pass::kForward));
      embed_forward(l0.values.data(), l0.values.data() + kW0, b, a.h0);
      STRATA_RETURN_IF_ERROR(give(p, l0));
      STRATA_ASSIGN_OR_RETURN(Held l1, take(p, kFrozen, Pass::kForward));
      residual_forward(l1.values.data(), b.size, a.h0, a.u1, a.h1);
      STRATA_RETURN_IF_ERROR(give(p, l1));
    }
    if (cond) {
      STRATA_ASSIGN_OR_RETURN(Held l2, take(p, kCond, Pass::kForward));
      residual_forward(l2.values.data(), b.size, a.h1, a.u2, a.h2);
      STRATA_RETURN_IF_ERROR(give(p, l2));
    } else {
      a.h2 = a.h1;
    }
    double loss = 0;
    {
      STRATA_ASSIGN_OR_RETURN(Held l3, take(p, kHead, Pass::kForward));
      STRATA_ASSIGN_OR_RETURN(Held l0, take(p, kEmbedIn, Pass::kForward));  // the tie, nested
      loss = head_forward(l3.values.data(), l0.values.data(), b, a.h2, a.probs);
      STRATA_RETURN_IF_ERROR(give(p, l0));
      STRATA_RETURN_IF_ERROR(give(p, l3));
    }
    // ---- backward
    std::vector<float> dh2, dh1, dh0;
    {
      STRATA_ASSIGN_OR_RETURN(Held l3, take(p, kHead, Pass::kBackward));
      STRATA_ASSIGN_OR_RETURN(Held l0, take(p, kEmbedIn, Pass::kBackward));  // the tie's gradient first
      std::vector<float> d_wh(kWh), d_w0(kW0);
      head_backward(l3.values.data(), l0.values.data(), b, a, grad_scale, d_wh.data(), d_w0.data(), dh2);
      STRATA_RETURN_IF_ERROR(accumulate(l3, 0, d_wh));
      STRATA_RETURN_IF_ERROR(accumulate(l0, 0, d_w0));
      STRATA_RETURN_IF_ERROR(give(p, l0));
      STRATA_RETURN_IF_ERROR(give(p, l3));
    }
    if (cond) {
      if (order == MlpOrder::kRecompute) {
        // Activation checkpointing: the layer's forward again, in backward.
        STRATA_ASSIGN_OR_RETURN(Held f, take(p, kCond, Pass::kForward));
        std::vector<float> h2;
        residual_forward(f.values.data(), b.size, a.h1, a.u2, h2);
        STRATA_RETURN_IF_ERROR(give(p, f));
      }
      STRATA_ASSIGN_OR_RETURN(Held l2, take(p, kCond, Pass::kBackward));
      std::vector<float> d_w2(kW2);
      residual_backward(l2.values.data(), b.size, a.h1, a.u2, dh2, d_w2.data(), dh1);
      STRATA_RETURN_IF_ERROR(accumulate(l2, 0, d_w2));
      STRATA_RETURN_IF_ERROR(give(p, l2));
    } else {
      dh1 = dh2;
    }
    std::vector<float> d_w0(kW0), d_b0(kB0);
    if (order == MlpOrder::kSwapBackward) {
      STRATA_ASSIGN_OR_RETURN(Held l0, take(p, kEmbedIn, Pass::kBackward));
      STRATA_ASSIGN_OR_RETURN(Held l1, take(p, kFrozen, Pass::kBackward));
      residual_backward<float>(l1.values.data(), b.size, a.h0, a.u1, dh1, nullptr, dh0);
      STRATA_RETURN_IF_ERROR(give(p, l1));
      embed_backward(b, a, dh0, d_w0.data(), d_b0.data());
      STRATA_RETURN_IF_ERROR(accumulate(l0, 0, d_w0));
      STRATA_RETURN_IF_ERROR(accumulate(l0, kW0, d_b0));
      STRATA_RETURN_IF_ERROR(give(p, l0));
    } else {
      STRATA_ASSIGN_OR_RETURN(Held l1, take(p, kFrozen, Pass::kBackward));
      residual_backward<float>(l1.values.data(), b.size, a.h0, a.u1, dh1, nullptr, dh0);
      STRATA_RETURN_IF_ERROR(give(p, l1));
      STRATA_ASSIGN_OR_RETURN(Held l0, take(p, kEmbedIn, Pass::kBackward));
      embed_backward(b, a, dh0, d_w0.data(), d_b0.data());
      STRATA_RETURN_IF_ERROR(accumulate(l0, 0, d_w0));
      STRATA_RETURN_IF_ERROR(accumulate(l0, kW0, d_b0));
      STRATA_RETURN_IF_ERROR(give(p, l0));
    }
    return loss;
  }

  // One evaluation batch through kEval acquires (the full model, the
  // conditional layer included); `frozen_bytes`, when given, receives the
  // frozen layer's bytes as the provider handed them.
  Result<double> eval_batch(ParameterProvider& p, const Batch& b, std::vector<std::byte>* frozen_bytes = nullptr) {
    Activations<float> a;
    {
      STRATA_ASSIGN_OR_RETURN(Held l0, take(p, kEmbedIn, Pass::kEval));
      embed_forward(l0.values.data(), l0.values.data() + kW0, b, a.h0);
      STRATA_RETURN_IF_ERROR(give(p, l0));
    }
    {
      STRATA_ASSIGN_OR_RETURN(Held l1, take(p, kFrozen, Pass::kEval));
      if (frozen_bytes != nullptr) frozen_bytes->assign(l1.mem.params, l1.mem.params + layers_[kFrozen].param_bytes);
      residual_forward(l1.values.data(), b.size, a.h0, a.u1, a.h1);
      STRATA_RETURN_IF_ERROR(give(p, l1));
    }
    {
      STRATA_ASSIGN_OR_RETURN(Held l2, take(p, kCond, Pass::kEval));
      residual_forward(l2.values.data(), b.size, a.h1, a.u2, a.h2);
      STRATA_RETURN_IF_ERROR(give(p, l2));
    }
    STRATA_ASSIGN_OR_RETURN(Held l3, take(p, kHead, Pass::kEval));
    STRATA_ASSIGN_OR_RETURN(Held l0, take(p, kEmbedIn, Pass::kEval));
    const double loss = head_forward(l3.values.data(), l0.values.data(), b, a.h2, a.probs);
    STRATA_RETURN_IF_ERROR(give(p, l0));
    STRATA_RETURN_IF_ERROR(give(p, l3));
    return loss;
  }

 private:
  struct Held {
    size_t layer = 0;
    Pass pass = Pass::kForward;
    LayerMemory mem;
    std::vector<float> values;  // the parameters in fp32
  };

  Result<Held> take(ParameterProvider& p, size_t li, Pass pass) {
    Held h;
    h.layer = li;
    h.pass = pass;
    STRATA_ASSIGN_OR_RETURN(h.mem, p.acquire(li, pass));
    STRATA_RETURN_IF_ERROR(h.mem.ready.wait().with_context(fmt::format("layer {} ready for {}", li, pass_name(pass))));
    const LayerSpec& spec = layers_[li];
    if (h.mem.params == nullptr)
      return Internal(fmt::format("acquire({}, {}) returned no parameters", li, pass_name(pass)));
    if (h.mem.params_tier == Tier::kNvme)
      return Internal(fmt::format("acquire({}, {}) returned NVMe-tier parameters", li, pass_name(pass)));
    const bool frozen = layer_frozen(spec);
    if (pass == Pass::kBackward && !frozen && h.mem.grads == nullptr)
      return Internal(fmt::format("acquire({}, backward) of a trainable layer returned no gradient buffer", li));
    if ((pass != Pass::kBackward || frozen) && h.mem.grads != nullptr)
      return Internal(fmt::format("acquire({}, {}) of a {} layer returned a gradient buffer (the contract: null)", li,
                                  pass_name(pass), frozen ? "frozen" : "trainable"));
    h.values = to_floats(h.mem.params, spec.params.front().dtype, spec.param_count);
    return h;
  }

  Status give(ParameterProvider& p, const Held& h) { return p.release(h.layer, h.pass, Completion()); }

  // grads[offset + i] += contribution[i], in fp32, rounded once to the buffer's dtype.
  static Status accumulate(const Held& h, size_t offset, std::span<const float> contribution) {
    if (h.mem.grads == nullptr) return Internal(fmt::format("layer {}: no gradient buffer", h.layer));
    for (size_t i = 0; i < contribution.size(); ++i) {
      const size_t at = offset + i;
      switch (h.mem.grad_dtype) {
        case DType::kF32:
          static_cast<float*>(h.mem.grads)[at] += contribution[i];
          break;
        case DType::kBF16: {
          uint16_t& g = static_cast<uint16_t*>(h.mem.grads)[at];
          g = fp32_to_bf16_bits(bf16_bits_to_fp32(g) + contribution[i]);
          break;
        }
        case DType::kF16: {
          uint16_t& g = static_cast<uint16_t*>(h.mem.grads)[at];
          g = fp32_to_fp16_bits(fp16_bits_to_fp32(g) + contribution[i]);
          break;
        }
        default:
          return Internal(fmt::format("gradient dtype {}", dtype_name(h.mem.grad_dtype)));
      }
    }
    return Status::Ok();
  }

  std::vector<LayerSpec> layers_;
};

// ---------------------------------------------------------------- the fp32 reference trainer

struct ReferenceOptions {
  int world = 1;
  int grad_accum = 1;
  int batch = 8;  // per rank and micro-batch
  uint64_t data_seed = 7;
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  double grad_clip = 0.0;  // 0: off
  MlpSpecOptions spec;
};

// Plain loops, fp32 state: per step, every rank's micro-batches forward and
// backward (each rank's gradient accumulated over its micro-batches with the
// loss gradient scaled by 1 / (world x grad_accum), as the engine's
// gradient_scale()), summed over ranks in rank order; the global norm over
// the trainable tensors (fp64 sum of squares); torch's clip coefficient
// min(1, clip / (norm + 1e-6)); AdamW per tensor with that tensor's weight
// decay and lr (x lr_scale), bias correction, in the float operations of
// Note [Update formulas] (cpu_adam/src/reference.cpp). The frozen layer is
// never touched; the conditional layer gets a zero gradient on even steps
// and is stepped like every other.
class ReferenceTrainer {
 public:
  ReferenceTrainer(const ReferenceOptions& o, std::vector<std::vector<float>> init) : o_(o), p_(std::move(init)) {
    for (size_t li = 0; li < kLayerCount; ++li) {
      m_.emplace_back(p_[li].size(), 0.0f);
      v_.emplace_back(p_[li].size(), 0.0f);
    }
  }

  // Step `step` (1-based); returns the mean loss over every rank's micro-batches.
  double step(int64_t step) {
    const bool cond = cond_used(step);
    const double scale = 1.0 / (static_cast<double>(o_.world) * o_.grad_accum);
    std::vector<std::vector<float>> total;
    double loss_all = 0;
    for (int r = 0; r < o_.world; ++r) {
      std::vector<std::vector<float>> g;
      for (size_t li = 0; li < kLayerCount; ++li) g.emplace_back(p_[li].size(), 0.0f);
      double loss_rank = 0;
      for (int k = 0; k < o_.grad_accum; ++k) {
        const Batch b = make_batch(o_.data_seed, step, k, r, o_.batch);
        const Weights<float> w = weights();
        Activations<float> a;
        loss_rank += forward(w, b, cond, a);
        const Contributions<float> c = backward(w, b, cond, a, scale);
        add(g[kHead], 0, c.wh);
        add(g[kEmbedIn], 0, c.w0_tie);
        if (cond) add(g[kCond], 0, c.w2);
        add(g[kEmbedIn], 0, c.w0_enc);
        add(g[kEmbedIn], kW0, c.b0);
      }
      loss_all += loss_rank;
      if (r == 0) {
        total = std::move(g);
      } else {
        for (size_t li = 0; li < kLayerCount; ++li) add(total[li], 0, g[li]);
      }
    }
    double sum_squares = 0;
    for (size_t li = 0; li < kLayerCount; ++li) {
      if (li == kFrozen) continue;
      for (float x : total[li]) sum_squares += static_cast<double>(x) * x;
    }
    last_grad_norm_ = std::sqrt(sum_squares);
    last_clip_ = 1.0f;
    if (o_.grad_clip > 0.0) {
      const double coef = o_.grad_clip / (last_grad_norm_ + 1e-6);
      if (coef < 1.0) last_clip_ = static_cast<float>(coef);
    }
    ++steps_;
    const float bias_decay = o_.spec.bias_no_decay ? 0.0f : -1.0f;  // -1: the optimizer's
    adamw(kEmbedIn, 0, kW0, total[kEmbedIn], 1.0, -1.0);
    adamw(kEmbedIn, kW0, kB0, total[kEmbedIn], 1.0, bias_decay);
    adamw(kCond, 0, kW2, total[kCond], 1.0, -1.0);
    adamw(kHead, 0, kWh, total[kHead], o_.spec.head_lr_scale ? kHeadLrScale : 1.0, -1.0);
    return loss_all / (static_cast<double>(o_.world) * o_.grad_accum);
  }

  double eval(const Batch& b) const {
    Activations<float> a;
    return forward(weights(), b, /*cond=*/true, a);
  }

  const std::vector<float>& params(size_t li) const { return p_[li]; }
  double last_grad_norm() const { return last_grad_norm_; }
  float last_clip() const { return last_clip_; }

 private:
  Weights<float> weights() const {
    Weights<float> w;
    w.w0 = p_[kEmbedIn].data();
    w.b0 = p_[kEmbedIn].data() + kW0;
    w.w1 = p_[kFrozen].data();
    w.w2 = p_[kCond].data();
    w.wh = p_[kHead].data();
    return w;
  }

  static void add(std::vector<float>& into, size_t offset, std::span<const float> c) {
    for (size_t i = 0; i < c.size(); ++i) into[offset + i] += c[i];
  }

  // Elements [begin, begin + count) of layer li; decay < 0: the optimizer's.
  void adamw(size_t li, size_t begin, size_t count, const std::vector<float>& grads, double lr_scale, double decay) {
    const double lr = o_.lr * lr_scale;
    const double wd = decay < 0 ? o_.weight_decay : decay;
    const double t = static_cast<double>(steps_);
    const float grad_multiplier = last_clip_;  // clip / loss scale 1
    const float one_minus_beta1 = static_cast<float>(1.0 - o_.beta1);
    const float beta2 = static_cast<float>(o_.beta2);
    const float one_minus_beta2 = static_cast<float>(1.0 - o_.beta2);
    const float eps = static_cast<float>(o_.eps);
    const float decay_factor = static_cast<float>(1.0 - lr * wd);
    const float neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(o_.beta1, t)));
    const float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(o_.beta2, t)));
    for (size_t i = begin; i < begin + count; ++i) {
      float p = p_[li][i];
      const float g = grads[i] * grad_multiplier;
      float m = m_[li][i], v = v_[li][i];
      m = std::fma(one_minus_beta1, g - m, m);
      v = std::fma(one_minus_beta2 * g, g, v * beta2);
      const float denom = std::fma(std::sqrt(v), inv_bc2_sqrt, eps);
      if (wd != 0.0) p = p * decay_factor;
      p = std::fma(neg_step_size, m / denom, p);
      p_[li][i] = p;
      m_[li][i] = m;
      v_[li][i] = v;
    }
  }

  ReferenceOptions o_;
  std::vector<std::vector<float>> p_, m_, v_;
  int64_t steps_ = 0;
  double last_grad_norm_ = 0;
  float last_clip_ = 1.0f;
};

}  // namespace strata::mlp
