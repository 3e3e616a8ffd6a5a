// CpuOptimizer: validation, per-step factors, tiling and threading. The
// arithmetic lives in the kernel tables (reference.cpp, x86/).
//
// Note [Tiles and threads]
// The state is cut into tiles of tile_elements (default 64 Ki elements:
// 256 KiB per fp32 stream, ~1.1 MiB for the 4-5 streams of Adam, within the
// per-core L2). Tiles are independent; with threads > 1 they are handed to
// a oneTBB arena of that many threads, one tile per task
// (simple_partitioner), and the tile callback runs right after its tile on
// the same worker, so a caller can copy tile k to the device while tile
// k + threads is being computed. With threads == 1 no arena is used and
// tiles run in order on the calling thread.
//
// Note [Overflow without partial writes]
// A step must leave every state bit-identical when the gradient holds an
// Inf or NaN. Detecting it inside the update pass would find it only after
// earlier tiles were written, and Adam cannot be undone exactly. So the
// decision is made before the first write: kScanFirst reads the gradient
// once (sum of squares in double, non-finite iff some element is), costing
// one extra read of the gradient stream; kAssumeFinite takes the answer from
// the caller, who gets it from grad_stats() -- the pass global clipping and
// the cross-rank overflow vote need anyway -- so the step itself reads each
// stream exactly once.
#include "strata/cpu_adam/optimizer.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <thread>

#include "float_environment.h"
#include "kernels.h"

namespace strata::cpu_adam {

using detail::CopyType;
using detail::KernelTable;
using detail::StepFactors;
using detail::TileSpans;

struct CpuOptimizer::Impl {
  OptimizerOptions options;
  KernelPathChoice choice;
  const KernelTable* kernels = nullptr;
  std::unique_ptr<tbb::task_arena> arena;  // null when threads == 1

  // Runs fn(tile_index) for every tile, on the arena or inline.
  template <typename Fn>
  void for_each_tile(size_t tiles, const Fn& fn) {
    // Inline under TSan too (STRATA_TSAN_SERIAL_LOOPS): oneTBB's scheduler is
    // not instrumented, so TSan would see no ordering with its workers.
    if (!arena || tiles <= 1 || STRATA_TSAN_SERIAL_LOOPS) {
      for (size_t i = 0; i < tiles; ++i) fn(i);
      return;
    }
    arena->execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, tiles, 1),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t i = r.begin(); i != r.end(); ++i) fn(i);
          },
          tbb::simple_partitioner());
    });
  }
};

namespace {

const KernelTable& kernels_for(KernelPath path) {
  switch (path) {
#if STRATA_CPU_ADAM_SIMD
    case KernelPath::kAvx2: return detail::avx2_kernels();
    case KernelPath::kAvx512: return detail::avx512_kernels();
    case KernelPath::kAvx512Bf16: return detail::avx512_bf16_kernels();
#endif
    default: return detail::scalar_kernels();
  }
}

Status check_span(const void* ptr, std::string_view field, std::string_view kind, size_t count) {
  if (ptr != nullptr) return Status::Ok();
  return InvalidArgument(fmt::format("StateSpans.{} is null but {} needs it for {} elements; point it at the "
                                     "state (count = 0 for an empty step)", field, kind, count));
}

// The rest of validate_state for MomentFormat::kBlockInt8 (spans already checked).
Status validate_int8_moments(OptimizerKind kind, const StateSpans& s) {
  if (kind != OptimizerKind::kAdam && kind != OptimizerKind::kAdamW) {
    return InvalidArgument(fmt::format("StateSpans.moment_format = kBlockInt8 is implemented for adam and adamw, not "
                                   "{}; use MomentFormat::kDType (fp32 or bf16 moments) for {}",
                                   optimizer_kind_name(kind), optimizer_kind_name(kind)));
  }
  STRATA_RETURN_IF_ERROR(validate_moment_block_elements(s.moment_block_elements, "StateSpans.moment_block_elements"));
  const std::string_view name = optimizer_kind_name(kind);
  const size_t blocks = moment_block_count(s.count, s.moment_block_elements);
  STRATA_RETURN_IF_ERROR(check_span(s.exp_avg_scale, "exp_avg_scale", name, blocks));
  STRATA_RETURN_IF_ERROR(check_span(s.exp_avg_sq_scale, "exp_avg_sq_scale", name, blocks));
  return Status::Ok();
}

// An out-of-place step's sources (StateSpans::*_source): every stream the
// kind reads has one, each its output span itself or not overlapping it.
Status validate_sources(OptimizerKind kind, const StateSpans& s) {
  const bool int8 = s.moment_format == MomentFormat::kBlockInt8;
  if (s.params_source == nullptr) {
    if (s.exp_avg_source != nullptr || s.exp_avg_sq_source != nullptr || s.exp_avg_scale_source != nullptr ||
        s.exp_avg_sq_scale_source != nullptr)
      return InvalidArgument("StateSpans: a moment source is set but params_source is null; an out-of-place step "
                             "needs params_source too (or leave every *_source null to step in place)");
    return Status::Ok();
  }
  const std::string_view name = optimizer_kind_name(kind);
  const size_t moment_bytes = int8 ? 1 : dtype_size(s.moment_dtype);
  const size_t blocks = int8 ? moment_block_count(s.count, s.moment_block_elements) : 0;
  struct Stream {
    const void* source;
    const void* output;
    size_t bytes;
    std::string_view field;
    bool used;
  };
  const Stream streams[] = {
      {s.params_source, s.params, s.count * sizeof(float), "params_source", true},
      {s.exp_avg_source, s.exp_avg, s.count * moment_bytes, "exp_avg_source", detail::uses_exp_avg(kind)},
      {s.exp_avg_sq_source, s.exp_avg_sq, s.count * moment_bytes, "exp_avg_sq_source", detail::uses_exp_avg_sq(kind)},
      {s.exp_avg_scale_source, s.exp_avg_scale, blocks * sizeof(float), "exp_avg_scale_source", int8},
      {s.exp_avg_sq_scale_source, s.exp_avg_sq_scale, blocks * sizeof(float), "exp_avg_sq_scale_source", int8},
  };
  for (const Stream& st : streams) {
    if (!st.used) continue;
    if (st.source == nullptr)
      return InvalidArgument(fmt::format("StateSpans.{} is null but params_source is set: an out-of-place {} step "
                                         "reads every stream it updates from its source",
                                         st.field, name));
    const auto source = reinterpret_cast<uintptr_t>(st.source), output = reinterpret_cast<uintptr_t>(st.output);
    if (source != output && source < output + st.bytes && output < source + st.bytes)
      return InvalidArgument(fmt::format("StateSpans.{} overlaps its output span without being it; an out-of-place "
                                         "step needs disjoint spans (or the same span to step in place)",
                                         st.field));
  }
  return Status::Ok();
}

Status validate_state(OptimizerKind kind, const StateSpans& s) {
  if (s.count == 0) return Status::Ok();
  const std::string_view name = optimizer_kind_name(kind);
  STRATA_RETURN_IF_ERROR(check_span(s.params, "params", name, s.count));
  STRATA_RETURN_IF_ERROR(check_span(s.grads, "grads", name, s.count));
  if (detail::uses_exp_avg(kind)) STRATA_RETURN_IF_ERROR(check_span(s.exp_avg, "exp_avg", name, s.count));
  if (detail::uses_exp_avg_sq(kind)) STRATA_RETURN_IF_ERROR(check_span(s.exp_avg_sq, "exp_avg_sq", name, s.count));
  if (!is_state_float(s.grad_dtype)) {
    return InvalidArgument(fmt::format("StateSpans.grad_dtype = {} is not supported; use fp32, bf16 or fp16",
                                       dtype_name(s.grad_dtype)));
  }
  if (s.moment_format == MomentFormat::kBlockInt8) {
    STRATA_RETURN_IF_ERROR(validate_int8_moments(kind, s));
  } else if (s.moment_format != MomentFormat::kDType) {
    return InvalidArgument(fmt::format("StateSpans.moment_format = {} is not a MomentFormat",
                                       static_cast<int>(s.moment_format)));
  } else if (s.moment_dtype != DType::kF32 && s.moment_dtype != DType::kBF16) {
    return InvalidArgument(fmt::format("StateSpans.moment_dtype = {} is not supported; use fp32 or bf16",
                                       dtype_name(s.moment_dtype)));
  }
  if (s.param_copy != nullptr && s.param_copy_dtype != DType::kBF16 && s.param_copy_dtype != DType::kF16 &&
      s.param_copy_dtype != DType::kF32) {
    return InvalidArgument(fmt::format("StateSpans.param_copy_dtype = {} is not supported; use bf16 or fp16",
                                       dtype_name(s.param_copy_dtype)));
  }
  if (s.param_copy != nullptr && s.param_copy_dtype == DType::kF32) {
    return InvalidArgument("StateSpans.param_copy_dtype = fp32: the fp32 params are already the master copy; "
                           "use bf16 or fp16 for the copy, or leave param_copy null");
  }
  return validate_sources(kind, s);
}

// Note [Non-temporal copy] (x86/kernel_body.h): on unless STRATA_CPU_ADAM_NT_COPY=0.
bool non_temporal_copy() {
  static const bool on = [] {
    const char* e = std::getenv("STRATA_CPU_ADAM_NT_COPY");
    return !(e != nullptr && e[0] == '0' && e[1] == '\0');
  }();
  return on;
}

}  // namespace

UpdateScalars update_scalars(OptimizerKind kind, const StepArgs& a) {
  const HyperParams& h = a.hyper;
  UpdateScalars f;
  f.grad_multiplier = static_cast<float>(a.clip_coefficient / a.loss_scale);
  f.neg_lr = static_cast<float>(-h.lr);
  f.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  f.beta2 = static_cast<float>(h.beta2);
  f.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  f.eps = static_cast<float>(h.eps);
  f.weight_decay = static_cast<float>(h.weight_decay);
  const bool decoupled = kind == OptimizerKind::kAdamW || kind == OptimizerKind::kLion;
  f.l2_decay = !decoupled && h.weight_decay != 0.0;
  f.decoupled_decay = decoupled && h.weight_decay != 0.0;
  f.decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
  // Bias corrections folded into two per-step scalars (Note [Update formulas]).
  if (h.bias_correction) {
    const double t = static_cast<double>(a.step);
    const double bc1 = 1.0 - std::pow(h.beta1, t);
    const double bc2 = 1.0 - std::pow(h.beta2, t);
    f.neg_step_size = static_cast<float>(-h.lr / bc1);
    f.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  } else {
    f.neg_step_size = static_cast<float>(-h.lr);
    f.inv_bias_correction2_sqrt = 1.0f;
  }
  return f;
}

namespace {

StepFactors make_factors(OptimizerKind kind, const StepArgs& a) {
  const UpdateScalars u = update_scalars(kind, a);
  StepFactors f;
  f.kind = kind;
  f.copy_non_temporal = non_temporal_copy();
  f.grad_multiplier = u.grad_multiplier;
  f.neg_lr = u.neg_lr;
  f.one_minus_beta1 = u.one_minus_beta1;
  f.beta2 = u.beta2;
  f.one_minus_beta2 = u.one_minus_beta2;
  f.eps = u.eps;
  f.weight_decay = u.weight_decay;
  f.l2_decay = u.l2_decay;
  f.decay_factor = u.decay_factor;
  f.decoupled_decay = u.decoupled_decay;
  f.neg_step_size = u.neg_step_size;
  f.inv_bias_correction2_sqrt = u.inv_bias_correction2_sqrt;
  return f;
}

Status validate_args(OptimizerKind kind, const StepArgs& a) {
  if (a.step < 1) {
    return InvalidArgument(fmt::format("StepArgs.step = {}: steps count from 1 (the first update is step 1)", a.step));
  }
  if (!(std::isfinite(a.loss_scale) && a.loss_scale > 0.0)) {
    return InvalidArgument(fmt::format("StepArgs.loss_scale = {} must be finite and > 0 (1 when not scaling)",
                                       a.loss_scale));
  }
  if (!(std::isfinite(a.clip_coefficient) && a.clip_coefficient > 0.0)) {
    return InvalidArgument(fmt::format("StepArgs.clip_coefficient = {} must be finite and > 0 (1 when not "
                                       "clipping; see clip_coefficient())", a.clip_coefficient));
  }
  return validate_hyper_params(kind, a.hyper);
}

TileSpans tile_of(const StateSpans& s, size_t begin, size_t count) {
  TileSpans t;
  t.count = count;
  t.params = s.params + begin;
  t.grads = static_cast<const char*>(s.grads) + begin * dtype_size(s.grad_dtype);
  t.grad_dtype = s.grad_dtype;
  t.moment_dtype = s.moment_dtype;
  const bool int8 = s.moment_format == MomentFormat::kBlockInt8;
  const size_t moment_bytes = int8 ? 1 : dtype_size(s.moment_dtype);
  if (int8) {  // begin is a multiple of the block (check_int8_tiles)
    t.block_elements = s.moment_block_elements;
    t.exp_avg_scale = s.exp_avg_scale + begin / s.moment_block_elements;
    t.exp_avg_sq_scale = s.exp_avg_sq_scale + begin / s.moment_block_elements;
  }
  if (s.exp_avg != nullptr) t.exp_avg = static_cast<char*>(s.exp_avg) + begin * moment_bytes;
  if (s.exp_avg_sq != nullptr) t.exp_avg_sq = static_cast<char*>(s.exp_avg_sq) + begin * moment_bytes;
  if (s.param_copy != nullptr) {
    t.param_copy = static_cast<char*>(s.param_copy) + begin * 2;
    t.copy_type = s.param_copy_dtype == DType::kBF16 ? CopyType::kBF16 : CopyType::kF16;
  }
  // Where the update reads: the outputs themselves unless out of place.
  t.params_in = t.params;
  t.exp_avg_in = t.exp_avg;
  t.exp_avg_sq_in = t.exp_avg_sq;
  t.exp_avg_scale_in = t.exp_avg_scale;
  t.exp_avg_sq_scale_in = t.exp_avg_sq_scale;
  if (s.params_source != nullptr) {
    t.params_in = s.params_source + begin;
    if (s.exp_avg_source != nullptr) t.exp_avg_in = static_cast<const char*>(s.exp_avg_source) + begin * moment_bytes;
    if (s.exp_avg_sq_source != nullptr)
      t.exp_avg_sq_in = static_cast<const char*>(s.exp_avg_sq_source) + begin * moment_bytes;
    if (int8) {
      t.exp_avg_scale_in = s.exp_avg_scale_source + begin / s.moment_block_elements;
      t.exp_avg_sq_scale_in = s.exp_avg_sq_scale_source + begin / s.moment_block_elements;
    }
  }
  return t;
}

// Blocks must not straddle tiles: every tile then starts on a block boundary.
Status check_int8_tiles(const StateSpans& s, size_t tile_elements) {
  if (s.moment_format != MomentFormat::kBlockInt8 || tile_elements % s.moment_block_elements == 0)
    return Status::Ok();
  return InvalidArgument(fmt::format("StateSpans.moment_block_elements = {} does not divide "
                                     "OptimizerOptions.tile_elements = {}; blocks must not straddle tiles",
                                     s.moment_block_elements, tile_elements));
}

}  // namespace

CpuOptimizer::CpuOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuOptimizer::CpuOptimizer(CpuOptimizer&&) noexcept = default;
CpuOptimizer& CpuOptimizer::operator=(CpuOptimizer&&) noexcept = default;
CpuOptimizer::~CpuOptimizer() = default;

Result<CpuOptimizer> CpuOptimizer::create(const OptimizerOptions& options) {
  if (options.threads < 0) {
    return InvalidArgument(fmt::format("OptimizerOptions.threads = {} must be >= 0 (0 = all cores)", options.threads));
  }
  // At most 2^31: a tile's element offsets and its rounding up to whole
  // tiles (count + tile - 1) stay far inside size_t.
  if (options.tile_elements < 64 || options.tile_elements % 64 != 0 || options.tile_elements > (size_t{1} << 31)) {
    return InvalidArgument(fmt::format("OptimizerOptions.tile_elements = {} must be a multiple of 64 in 64..{}, "
                                       "e.g. 65536", options.tile_elements, size_t{1} << 31));
  }
  STRATA_ASSIGN_OR_RETURN(KernelPathChoice choice, resolve_kernel_path(options.path));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (impl->options.threads == 0) {
    impl->options.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }
  impl->choice = std::move(choice);
  impl->kernels = &kernels_for(impl->choice.path);
  if (impl->options.threads > 1) {
    impl->arena = std::make_unique<tbb::task_arena>(impl->options.threads);
    impl->arena->initialize();
  }
  return CpuOptimizer(std::move(impl));
}

OptimizerKind CpuOptimizer::kind() const { return impl_->options.kind; }
KernelPath CpuOptimizer::path() const { return impl_->choice.path; }
const std::string& CpuOptimizer::path_reason() const { return impl_->choice.reason; }
int CpuOptimizer::threads() const { return impl_->options.threads; }
size_t CpuOptimizer::tile_elements() const { return impl_->options.tile_elements; }

size_t CpuOptimizer::bytes_per_element(OptimizerKind kind, const StateSpans& s) {
  const size_t moment = s.moment_format == MomentFormat::kBlockInt8 ? 1 : dtype_size(s.moment_dtype);
  size_t bytes = 4 + 4 + dtype_size(s.grad_dtype);  // params read + write, grads read
  if (detail::uses_exp_avg(kind)) bytes += 2 * moment;
  if (detail::uses_exp_avg_sq(kind)) bytes += 2 * moment;
  if (s.param_copy != nullptr) bytes += 2;
  return bytes;
}

uint64_t CpuOptimizer::bytes_per_step(OptimizerKind kind, const StateSpans& s) {
  uint64_t bytes = static_cast<uint64_t>(bytes_per_element(kind, s)) * s.count;
  if (s.moment_format == MomentFormat::kBlockInt8) {
    const uint64_t blocks = moment_block_count(s.count, s.moment_block_elements);
    if (detail::uses_exp_avg(kind)) bytes += 2 * 4 * blocks;  // each scale read and written
    if (detail::uses_exp_avg_sq(kind)) bytes += 2 * 4 * blocks;
  }
  return bytes;
}

Result<GradStats> CpuOptimizer::grad_stats(const void* grads, DType grad_dtype, size_t count) {
  if (count == 0) return GradStats{};
  if (grads == nullptr) {
    return InvalidArgument(fmt::format("grad_stats: grads is null but count = {}", count));
  }
  if (!is_state_float(grad_dtype)) {
    return InvalidArgument(fmt::format("grad_stats: grad dtype {} is not supported; use fp32, bf16 or fp16",
                                       dtype_name(grad_dtype)));
  }
  const size_t tile = impl_->options.tile_elements;
  const size_t tiles = (count + tile - 1) / tile;
  std::vector<double> partial(tiles, 0.0);
  const size_t elem = dtype_size(grad_dtype);
  const auto* bytes = static_cast<const char*>(grads);
  impl_->for_each_tile(tiles, [&](size_t i) {
    const size_t begin = i * tile;
    const detail::SubnormalsKept subnormals;  // Note [Subnormals kept]
    partial[i] = impl_->kernels->sum_squares(bytes + begin * elem, grad_dtype, std::min(tile, count - begin));
  });
  GradStats stats;
  for (double p : partial) stats.sum_squares += p;
  stats.all_finite = std::isfinite(stats.sum_squares);
  return stats;
}

Result<StepReport> CpuOptimizer::step(const StepArgs& args, const StateSpans& state, const TileCallback& on_tile) {
  const OptimizerKind kind = impl_->options.kind;
  STRATA_RETURN_IF_ERROR(validate_args(kind, args));
  STRATA_RETURN_IF_ERROR(validate_state(kind, state));
  STRATA_RETURN_IF_ERROR(check_int8_tiles(state, impl_->options.tile_elements));
  StepReport report;
  if (state.count == 0) return report;
  if (args.overflow_check == OverflowCheck::kScanFirst) {
    STRATA_ASSIGN_OR_RETURN(GradStats stats, grad_stats(state.grads, state.grad_dtype, state.count));
    if (!stats.all_finite) {
      report.overflow = true;
      return report;
    }
  }
  const StepFactors factors = make_factors(kind, args);
  const size_t tile = impl_->options.tile_elements;
  const size_t tiles = (state.count + tile - 1) / tile;
  const KernelTable& k = *impl_->kernels;
  impl_->for_each_tile(tiles, [&](size_t i) {
    const size_t begin = i * tile;
    const size_t count = std::min(tile, state.count - begin);
    {
      const detail::SubnormalsKept subnormals;  // Note [Subnormals kept]
      k.update(factors, tile_of(state, begin, count));
    }
    if (on_tile) on_tile(TileRange{i, begin, count});
  });
  report.tiles = tiles;
  return report;
}

Status CpuOptimizer::stream_probe(const StateSpans& state, bool software_prefetch, ProbeKind probe) {
  const OptimizerKind kind = impl_->options.kind;
  STRATA_RETURN_IF_ERROR(validate_state(kind, state));
  STRATA_RETURN_IF_ERROR(check_int8_tiles(state, impl_->options.tile_elements));
  if (state.count == 0) return Status::Ok();
  StepFactors factors;
  factors.kind = kind;
  factors.probe_prefetch = software_prefetch;
  factors.copy_non_temporal = non_temporal_copy();
  const size_t tile = impl_->options.tile_elements;
  const size_t tiles = (state.count + tile - 1) / tile;
  const KernelTable& k = *impl_->kernels;
  const auto fn = probe == ProbeKind::kStreaming ? k.stream : k.probe;
  impl_->for_each_tile(tiles, [&](size_t i) {
    const size_t begin = i * tile;
    const detail::SubnormalsKept subnormals;  // Note [Subnormals kept]
    fn(factors, tile_of(state, begin, std::min(tile, state.count - begin)));
  });
  return Status::Ok();
}

std::string_view probe_kind_name(ProbeKind kind) {
  return kind == ProbeKind::kStreaming ? "streaming" : "conversion";
}

}  // namespace strata::cpu_adam
