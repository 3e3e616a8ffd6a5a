#pragma once
// CpuOptimizer: one optimizer step over a flat partition of training state
// (the fp32 master weights, moments and gradients of a ZeRO shard or
// sub-group), multi-threaded with oneTBB over cache-sized tiles.
//
//   auto opt = CpuOptimizer::create({.kind = OptimizerKind::kAdamW, .threads = 2});
//   StateSpans s{.count = n, .params = master, .grads = grads, .grad_dtype = DType::kBF16,
//                .exp_avg = m, .exp_avg_sq = v, .param_copy = bf16_out};
//   StepArgs a{.step = t, .hyper = {.lr = 1e-4, .weight_decay = 0.01}, .loss_scale = 1024};
//   STRATA_ASSIGN_OR_RETURN(StepReport r, opt->step(a, s, [&](const TileRange& tile) {
//     enqueue_h2d_copy(bf16_out + tile.begin, tile.count);  // runs on a worker thread
//   }));
//   if (r.overflow) ...  // nothing was written; lower the loss scale
//
// One step per optimizer object at a time; several objects may step
// concurrently. See docs/cpu_adam.md.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/grad_stats.h"
#include "strata/cpu_adam/hyper_params.h"
#include "strata/cpu_adam/int8_moments.h"
#include "strata/cpu_adam/kernel_path.h"

namespace strata::cpu_adam {

// Pointers into caller-owned memory; any alignment, no overlap.
struct StateSpans {
  size_t count = 0;                 // elements in every span
  float* params = nullptr;          // fp32 master weights, updated in place
  const void* grads = nullptr;      // read only
  DType grad_dtype = DType::kF32;   // fp32, bf16 or fp16
  void* exp_avg = nullptr;          // Adam/AdamW/Lion first moment; unused by Adagrad
  void* exp_avg_sq = nullptr;       // Adam/AdamW second moment, Adagrad sum of squares; unused by Lion
  DType moment_dtype = DType::kF32; // fp32 or bf16 (both moments), with MomentFormat::kDType
  void* param_copy = nullptr;       // optional: the updated params, rounded, written in the same pass
  DType param_copy_dtype = DType::kBF16;  // bf16 or fp16
  // MomentFormat::kBlockInt8 (Adam/AdamW only; int8_moments.h): exp_avg and
  // exp_avg_sq hold one uint8 code per element, the scale spans one fp32 per
  // block of moment_block_elements (a multiple of 64 dividing tile_elements);
  // moment_dtype is ignored.
  MomentFormat moment_format = MomentFormat::kDType;
  float* exp_avg_scale = nullptr;     // moment_block_count(count, moment_block_elements) scales
  float* exp_avg_sq_scale = nullptr;  // same count
  size_t moment_block_elements = kDefaultMomentBlockElements;
  // Out of place (optional; Note [Out-of-place steps] in docs/cpu_adam.md):
  // with params_source set, the step reads the state (params, the moments the
  // kind uses and, for 8-bit moments, their scales) from these spans, laid
  // out like the ones above, and writes the new state to the ones above,
  // leaving the sources unchanged: one pass, the same bytes moved as in
  // place. Each source is either its output span itself or does not overlap
  // it. All null: in place. stream_probe follows the same spans (the ceiling
  // of the out-of-place access pattern).
  const float* params_source = nullptr;
  const void* exp_avg_source = nullptr;
  const void* exp_avg_sq_source = nullptr;
  const float* exp_avg_scale_source = nullptr;
  const float* exp_avg_sq_scale_source = nullptr;
};

// How a step learns that the gradient holds an Inf or NaN. Either way an
// overflowing step writes nothing: every state stays bit-identical.
enum class OverflowCheck : uint8_t {
  // The step first reads the gradient once (a read-only pass, multi-threaded),
  // then updates. Costs one extra read of the gradient (4 of 28 bytes per
  // parameter for fp32 Adam: ~14%; 2 of 26 with bf16 gradients).
  kScanFirst = 0,
  // The caller already knows the gradient is finite, from grad_stats() (the
  // pass global clipping needs anyway) reduced over all ranks. No extra read.
  kAssumeFinite,
};

struct StepArgs {
  int64_t step = 1;  // 1-based count of this update; bias correction uses beta^step (pow, no drift)
  HyperParams hyper;
  // Fused gradient scaling: g * (clip_coefficient / loss_scale) is what the
  // optimizer sees. clip_coefficient comes from clip_coefficient() in grad_stats.h.
  double loss_scale = 1.0;
  double clip_coefficient = 1.0;
  OverflowCheck overflow_check = OverflowCheck::kScanFirst;
};

// The scalars one step derives once, in double, each rounded to float once
// (Note [Update formulas] in reference.cpp): the bias corrections and signs
// are folded in, so the per-element update needs no division by them. Every
// CPU path uses exactly these; a device kernel that must give the same bits
// (offload's device Adam) takes them from here instead of recomputing.
struct UpdateScalars {
  float grad_multiplier = 1.0f;            // clip_coefficient / loss_scale
  float neg_lr = 0.0f;                     // Adagrad, Lion: -lr
  float one_minus_beta1 = 0.0f;            // Adam/AdamW/Lion interpolation weight of m
  float beta2 = 0.0f;                      // Adam/AdamW
  float one_minus_beta2 = 0.0f;            // Adam/AdamW v weight, Lion m weight
  float eps = 0.0f;
  float weight_decay = 0.0f;               // Adam, Adagrad (L2 on the gradient)
  bool l2_decay = false;                   // Adam / Adagrad with weight_decay != 0
  float decay_factor = 1.0f;               // AdamW, Lion: 1 - lr * weight_decay
  bool decoupled_decay = false;            // AdamW / Lion with weight_decay != 0
  float neg_step_size = 0.0f;              // Adam/AdamW: -lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt = 1.0f;  // Adam/AdamW: 1 / sqrt(1 - beta2^t)
};
UpdateScalars update_scalars(OptimizerKind kind, const StepArgs& args);

struct TileRange {
  size_t index = 0;  // tile number
  size_t begin = 0;  // first element
  size_t count = 0;  // elements in this tile
};
// Called once per finished tile, on the thread that computed it, possibly
// concurrently with other tiles: must be thread-safe and must not throw.
// The tile's params, moments and param_copy are final when it runs.
using TileCallback = std::function<void(const TileRange&)>;

struct StepReport {
  bool overflow = false;  // gradient had Inf/NaN: nothing was written, no callback ran
  size_t tiles = 0;       // tiles computed (0 on overflow)
};

// What CpuOptimizer::stream_probe computes while moving the step's bytes.
enum class ProbeKind : uint8_t {
  kStreaming = 0,  // raw loads and stores, no arithmetic: the physical ceiling
  kConversion,     // dtype conversions + one add per stream (the pre-issue-9 probe)
};
std::string_view probe_kind_name(ProbeKind kind);  // "streaming", "conversion"

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdamW;
  int threads = 0;               // 0: all logical cores; 1: the calling thread only
  size_t tile_elements = 65536;  // per tile (256 KiB per fp32 stream); multiple of 64
  KernelPath path = KernelPath::kAuto;
};

class CpuOptimizer {
 public:
  static Result<CpuOptimizer> create(const OptimizerOptions& options);
  CpuOptimizer(CpuOptimizer&&) noexcept;
  CpuOptimizer& operator=(CpuOptimizer&&) noexcept;
  ~CpuOptimizer();

  // One update of every element of `state`. Invalid spans or hyper-parameters
  // are an InvalidArgument naming the field; an overflow is not an error.
  Result<StepReport> step(const StepArgs& args, const StateSpans& state,
                          const TileCallback& on_tile = {});

  // Squared norm and finiteness of a gradient, same threads and tiles.
  Result<GradStats> grad_stats(const void* grads, DType grad_dtype, size_t count);

  // A probe with the step's access pattern, the ceiling step() is measured
  // against: it reads and writes exactly the streams step() would for
  // `state` (same bytes per element, same order), on the same path, threads
  // and tiles. kStreaming (the physical limit) moves the bytes with no
  // arithmetic and leaves params, grads and moments unchanged (only
  // param_copy is overwritten, with the low 16 bits of each param's bits);
  // kConversion goes through the dtype conversions with one add per stream
  // and overwrites the state. A plain loop, or with the step's software
  // prefetch when `software_prefetch`.
  Status stream_probe(const StateSpans& state, bool software_prefetch = false,
                      ProbeKind probe = ProbeKind::kStreaming);

  OptimizerKind kind() const;
  KernelPath path() const;
  const std::string& path_reason() const;
  int threads() const;
  size_t tile_elements() const;

  // Bytes step() reads plus writes per element for `state` (without the
  // kScanFirst pre-pass): e.g. 28 for fp32 Adam, 28 for bf16 grads + bf16 copy,
  // 16 for fp32 Adam with 8-bit moments (whose scales bytes_per_step adds).
  static size_t bytes_per_element(OptimizerKind kind, const StateSpans& state);
  // Bytes one step() moves in all: bytes_per_element * count, plus with
  // 8-bit moments each block scale read and written.
  static uint64_t bytes_per_step(OptimizerKind kind, const StateSpans& state);

 private:
  struct Impl;
  explicit CpuOptimizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::cpu_adam
