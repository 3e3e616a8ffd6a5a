#pragma once
// Private: the per-path kernel table. Every path (scalar reference,
// x86/avx2.cpp, x86/avx512*.cpp) implements the same three functions over
// one tile of elements; optimizer.cpp splits the work into tiles and
// threads and picks the table for the chosen path.

#include <cstddef>
#include <cstdint>

#include "strata/core/dtype.h"
#include "strata/cpu_adam/hyper_params.h"

namespace strata::cpu_adam::detail {

// Output copy of the parameters written in the same pass.
enum class CopyType : uint8_t { kNone = 0, kBF16, kF16 };

// Factors derived once per step (in double, rounded to float once), so that
// every path computes the same float operations in the same order. The bias
// corrections and signs are folded in here, so the per-element update needs
// no division by them (Note [Update formulas], reference.cpp).
struct StepFactors {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float grad_multiplier = 1.0f;  // clip_coefficient / loss_scale
  float neg_lr = 0.0f;           // Adagrad, Lion: -lr
  float one_minus_beta1 = 0.0f;  // Adam/AdamW/Lion interpolation weight of m
  float beta2 = 0.0f;            // Adam/AdamW
  float one_minus_beta2 = 0.0f;  // Adam/AdamW v weight, Lion m weight
  float eps = 0.0f;
  float weight_decay = 0.0f;     // Adam, Adagrad (L2 on the gradient)
  bool l2_decay = false;         // Adam / Adagrad with weight_decay != 0
  float decay_factor = 1.0f;     // AdamW, Lion: 1 - lr * weight_decay
  bool decoupled_decay = false;  // AdamW / Lion with weight_decay != 0
  float neg_step_size = 0.0f;    // Adam/AdamW: -lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt = 1.0f;  // Adam/AdamW: 1 / sqrt(1 - beta2^t)
  bool probe_prefetch = false;   // probes only: use the step's software prefetch
  bool copy_non_temporal = true; // SIMD paths: non-temporal stores for the copy (Note [Non-temporal copy])
};

// One tile: pointers already offset to the tile's first element.
struct TileSpans {
  size_t count = 0;
  float* params = nullptr;
  const void* grads = nullptr;
  DType grad_dtype = DType::kF32;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType moment_dtype = DType::kF32;
  void* param_copy = nullptr;
  CopyType copy_type = CopyType::kNone;
  // 8-bit moments (Note [Block-wise 8-bit moments]) when block_elements != 0:
  // exp_avg / exp_avg_sq are uint8 codes, the scales one per block, the
  // tile starting on a block boundary.
  size_t block_elements = 0;
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  // Where every pass reads the state: the outputs above (in place) or
  // disjoint spans of the same layout (StateSpans::*_source). Set by
  // tile_of.
  const float* params_in = nullptr;
  const void* exp_avg_in = nullptr;
  const void* exp_avg_sq_in = nullptr;
  const float* exp_avg_scale_in = nullptr;
  const float* exp_avg_sq_scale_in = nullptr;
};

struct KernelTable {
  void (*update)(const StepFactors& f, const TileSpans& t);
  // Same-arithmetic probe: reads and writes exactly the streams `update`
  // would for f.kind, with one add per stream (keeps the dtype conversions).
  void (*probe)(const StepFactors& f, const TileSpans& t);
  // Pure streaming probe: the same bytes read and written as `update`, with
  // no arithmetic and no conversion: every stream is loaded and stored back
  // unchanged; the 16-bit copy gets raw bytes of the params. The physical
  // limit of the access pattern (Note [Streaming probe], kernel_body.h).
  void (*stream)(const StepFactors& f, const TileSpans& t);
  // Sum of squares of the raw gradient in double (non-finite iff an element is).
  double (*sum_squares)(const void* grads, DType grad_dtype, size_t count);
};

const KernelTable& scalar_kernels();
#if STRATA_CPU_ADAM_SIMD
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
const KernelTable& avx512_bf16_kernels();
#endif

inline size_t byte_size(DType t) { return dtype_size(t); }
inline bool uses_exp_avg(OptimizerKind k) { return k != OptimizerKind::kAdagrad; }
inline bool uses_exp_avg_sq(OptimizerKind k) { return k != OptimizerKind::kLion; }

}  // namespace strata::cpu_adam::detail
