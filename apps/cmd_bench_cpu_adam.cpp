// strata bench cpu-adam: the CPU optimizer step against a streaming probe
// with the same access pattern, interleaved in one run.
//
//   strata bench cpu-adam [--params 64M] [--threads N] [--grad-dtype fp32|bf16|fp16]
//                         [--param-copy none|bf16|fp16] [--moment-dtype fp32|bf16|int8]
//                         [--moment-block 256]
//                         [--kernel adam|adamw|adagrad|lion] [--path auto|scalar|avx2|avx512|avx512_bf16]
//                         [--overflow-check assume-finite|scan] [--out-of-place] [--reps 10] [--json]
//
// --out-of-place: the step reads the state from one set of buffers and
// writes it to another (cpu_adam's StateSpans::*_source, as the engine's
// early updates do); the probes then follow the same out-of-place pattern,
// so the ceiling is that pattern's own.
//
// Note [The ceiling]
// An optimizer step is memory-bound, so the honest ceiling is the physical
// limit of its own access pattern: CpuOptimizer::stream_probe with
// ProbeKind::kStreaming reads and writes exactly the bytes the step does
// (same streams, bytes per element, order, tiles, threads and SIMD width)
// with no arithmetic at all, once as a plain loop and once with the step's
// software prefetch; the ceiling is the faster of the two and
// ratio = ceiling time / step time. The pre-issue-9 probe (dtype
// conversions + one add per stream, ProbeKind::kConversion) is timed too and
// reported as a second, named figure: it hides part of the arithmetic's cost
// and so flatters the step. All five run interleaved, the order rotating
// every rep, so they see the same machine state.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "command.h"
#include "sample_stats.h"
#include "strata/core/printable.h"
#include "strata/core/dtype.h"
#include "strata/core/units.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::cli {
namespace {

using namespace strata::cpu_adam;

struct BenchOptions {
  std::string params = "64M";
  int threads = 0;
  std::string grad_dtype = "fp32";
  std::string moment_dtype = "fp32";
  size_t moment_block = kDefaultMomentBlockElements;  // with --moment-dtype int8
  bool moment_block_given = false;                    // --moment-block was given (refused without int8)
  std::string param_copy = "none";
  std::string kernel = "adamw";
  std::string path = "auto";
  std::string overflow_check = "assume-finite";
  bool out_of_place = false;
  int reps = 10;
  bool json = false;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

Result<Buffer> allocate(size_t bytes, const char* what) {
  const size_t rounded = (bytes + 63) / 64 * 64;  // bytes <= kMaxParams * 4: no overflow
  void* p = std::aligned_alloc(64, std::max<size_t>(rounded, 64));
  if (p == nullptr) {
    return OutOfMemory(fmt::format("bench cpu-adam: could not allocate {} for {}; try a smaller --params",
                                   format_bytes(bytes, true), what));
  }
  return Buffer(static_cast<uint8_t*>(p));
}

// The most bytes per parameter of any one buffer: params are fp32, grads and
// moments at most fp32 (the scales of 8-bit moments are fewer).
constexpr size_t kMaxBytesPerParam = 4;
// The most parameters whose every buffer has a byte count that fits in
// size_t, rounded up to 64 by allocate(): 2^62 - 16 (2^62 wrapped to 0 before).
constexpr uint64_t kMaxParams = (std::numeric_limits<size_t>::max() - 63) / kMaxBytesPerParam;

Result<uint64_t> parse_params(const std::string& text) {
  STRATA_ASSIGN_OR_RETURN(uint64_t count, parse_count(text, "--params"));
  if (count == 0) return InvalidArgument("--params must be > 0, e.g. 64M");
  if (count > kMaxParams)
    return InvalidArgument(fmt::format(
        "--params {} is more than {}, the most whose buffers ({} bytes per parameter) have a byte count that fits in "
        "64 bits; give a count that fits in this machine's memory, e.g. 64M",
        printable(text, 64), kMaxParams, kMaxBytesPerParam));
  return count;
}

Result<DType> parse_grad_dtype(const std::string& text) {
  Result<DType> d = parse_dtype(text);
  if (d.ok() && is_state_float(*d)) return *d;
  return InvalidArgument(
      fmt::format("--grad-dtype '{}' is not a gradient dtype; use fp32, bf16 or fp16", printable(text, 64)));
}

// --moment-dtype: fp32 or bf16 moments, or block-wise 8-bit ones
// (MomentFormat::kBlockInt8, whose scales are fp32; `dtype` is then unused).
struct MomentChoice {
  bool int8 = false;
  DType dtype = DType::kF32;
};

Result<MomentChoice> parse_moment_dtype(const std::string& text) {
  if (text == "int8") return MomentChoice{true, DType::kF32};
  Result<DType> d = parse_dtype(text);
  if (d.ok() && (*d == DType::kF32 || *d == DType::kBF16)) return MomentChoice{false, *d};
  return InvalidArgument(fmt::format(
      "--moment-dtype '{}' is not a moment dtype; use fp32, bf16 or int8 (block-wise 8-bit, --kernel adam or adamw)",
      printable(text, 64)));
}

// --moment-block belongs to int8 moments, which adam and adamw implement.
Status check_moment_flags(const BenchOptions& o, OptimizerKind kind, bool int8) {
  if (!int8) {
    if (!o.moment_block_given) return Status::Ok();
    return InvalidArgument(fmt::format(
        "--moment-block {} applies to --moment-dtype int8 only (elements per scale of 8-bit moments); drop "
        "--moment-block or add --moment-dtype int8",
        o.moment_block));
  }
  if (kind != OptimizerKind::kAdam && kind != OptimizerKind::kAdamW)
    return InvalidArgument(fmt::format(
        "--moment-dtype int8 with --kernel {}: 8-bit moments are implemented for --kernel adam and adamw only; use "
        "--moment-dtype fp32 or bf16 with --kernel {}",
        optimizer_kind_name(kind), optimizer_kind_name(kind)));
  return validate_moment_block_elements(o.moment_block, "--moment-block");
}

Result<std::optional<DType>> parse_param_copy(const std::string& text) {
  if (text == "none") return std::optional<DType>();
  Result<DType> d = parse_dtype(text);
  if (d.ok() && (*d == DType::kBF16 || *d == DType::kF16)) return std::optional<DType>(*d);
  return InvalidArgument(fmt::format("--param-copy '{}' must be none, bf16 or fp16", printable(text, 64)));
}

Result<OverflowCheck> parse_overflow_check(const std::string& text) {
  if (text == "assume-finite") return OverflowCheck::kAssumeFinite;
  if (text == "scan") return OverflowCheck::kScanFirst;
  return InvalidArgument(fmt::format("--overflow-check '{}' must be assume-finite or scan", printable(text, 64)));
}

Status run_bench(const BenchOptions& o) {
  STRATA_ASSIGN_OR_RETURN(uint64_t count, parse_params(o.params));
  if (o.reps < 1) return InvalidArgument(fmt::format("--reps {} must be >= 1", o.reps));
  auto kind_or = parse_optimizer_kind(o.kernel);
  if (!kind_or.ok()) return kind_or.status().with_context("--kernel");
  const OptimizerKind kind = *kind_or;
  auto path_or = parse_kernel_path(o.path);
  if (!path_or.ok()) return path_or.status().with_context("--path");
  const KernelPath path = *path_or;
  STRATA_ASSIGN_OR_RETURN(const DType grad_dtype, parse_grad_dtype(o.grad_dtype));
  STRATA_ASSIGN_OR_RETURN(const MomentChoice moment_choice, parse_moment_dtype(o.moment_dtype));
  const bool int8 = moment_choice.int8;
  const DType moment_dtype = moment_choice.dtype;
  STRATA_RETURN_IF_ERROR(check_moment_flags(o, kind, int8));
  STRATA_ASSIGN_OR_RETURN(const std::optional<DType> param_copy, parse_param_copy(o.param_copy));
  const bool copy = param_copy.has_value();
  const DType copy_dtype = param_copy.value_or(DType::kBF16);
  STRATA_ASSIGN_OR_RETURN(const OverflowCheck check, parse_overflow_check(o.overflow_check));

  STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create({.kind = kind, .threads = o.threads, .path = path}));

  const size_t gsize = dtype_size(grad_dtype), msize = int8 ? 1 : dtype_size(moment_dtype);
  const size_t blocks = int8 ? moment_block_count(count, o.moment_block) : 1;
  STRATA_ASSIGN_OR_RETURN(Buffer params, allocate(count * 4, "params"));
  STRATA_ASSIGN_OR_RETURN(Buffer grads, allocate(count * gsize, "grads"));
  STRATA_ASSIGN_OR_RETURN(Buffer m, allocate(count * msize, "exp_avg"));
  STRATA_ASSIGN_OR_RETURN(Buffer v, allocate(count * msize, "exp_avg_sq"));
  Buffer copy_buf;  // --param-copy none: no copy buffer
  if (copy) {
    STRATA_ASSIGN_OR_RETURN(copy_buf, allocate(count * 2, "param copy"));
  }
  STRATA_ASSIGN_OR_RETURN(Buffer m_scale, allocate(blocks * 4, "exp_avg scales"));
  STRATA_ASSIGN_OR_RETURN(Buffer v_scale, allocate(blocks * 4, "exp_avg_sq scales"));
  std::memset(m_scale.get(), 0, blocks * 4);
  std::memset(v_scale.get(), 0, blocks * 4);
  // Touch every page with realistic values: params in [-1, 1), grads ~1e-3.
  uint32_t seed = 12345;
  auto* p = reinterpret_cast<float*>(params.get());
  for (size_t i = 0; i < count; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const float r = static_cast<float>(seed >> 8) * (1.0f / 8388608.0f) - 1.0f;
    p[i] = r;
    const float g = 1e-3f * r;
    if (grad_dtype == DType::kF32) reinterpret_cast<float*>(grads.get())[i] = g;
    if (grad_dtype == DType::kBF16) reinterpret_cast<uint16_t*>(grads.get())[i] = fp32_to_bf16_bits(g);
    if (grad_dtype == DType::kF16) reinterpret_cast<uint16_t*>(grads.get())[i] = fp32_to_fp16_bits(g);
  }
  std::memset(m.get(), 0, count * msize);
  std::memset(v.get(), 0, count * msize);
  if (copy) std::memset(copy_buf.get(), 0, count * 2);
  // --out-of-place: the outputs, a second set of state buffers (touched).
  Buffer params_out, m_out, v_out, m_scale_out, v_scale_out;
  if (o.out_of_place) {
    STRATA_ASSIGN_OR_RETURN(params_out, allocate(count * 4, "params (out of place)"));
    STRATA_ASSIGN_OR_RETURN(m_out, allocate(count * msize, "exp_avg (out of place)"));
    STRATA_ASSIGN_OR_RETURN(v_out, allocate(count * msize, "exp_avg_sq (out of place)"));
    STRATA_ASSIGN_OR_RETURN(m_scale_out, allocate(blocks * 4, "exp_avg scales (out of place)"));
    STRATA_ASSIGN_OR_RETURN(v_scale_out, allocate(blocks * 4, "exp_avg_sq scales (out of place)"));
    std::memcpy(params_out.get(), params.get(), count * 4);
    std::memset(m_out.get(), 0, count * msize);
    std::memset(v_out.get(), 0, count * msize);
    std::memset(m_scale_out.get(), 0, blocks * 4);
    std::memset(v_scale_out.get(), 0, blocks * 4);
  }

  StateSpans s{.count = count, .params = p, .grads = grads.get(), .grad_dtype = grad_dtype,
               .exp_avg = m.get(), .exp_avg_sq = v.get(), .moment_dtype = moment_dtype,
               .param_copy = copy ? copy_buf.get() : nullptr, .param_copy_dtype = copy_dtype};
  if (int8) {
    s.moment_format = MomentFormat::kBlockInt8;
    s.exp_avg_scale = reinterpret_cast<float*>(m_scale.get());
    s.exp_avg_sq_scale = reinterpret_cast<float*>(v_scale.get());
    s.moment_block_elements = o.moment_block;
  }
  if (o.out_of_place) {
    s.params_source = s.params;
    s.exp_avg_source = s.exp_avg;
    s.exp_avg_sq_source = s.exp_avg_sq;
    s.params = reinterpret_cast<float*>(params_out.get());
    s.exp_avg = m_out.get();
    s.exp_avg_sq = v_out.get();
    if (int8) {
      s.exp_avg_scale_source = s.exp_avg_scale;
      s.exp_avg_sq_scale_source = s.exp_avg_sq_scale;
      s.exp_avg_scale = reinterpret_cast<float*>(m_scale_out.get());
      s.exp_avg_sq_scale = reinterpret_cast<float*>(v_scale_out.get());
    }
  }
  // Per parameter, with the scales of 8-bit moments spread over their blocks.
  const double bytes = static_cast<double>(CpuOptimizer::bytes_per_step(kind, s));
  const double bpe = bytes / static_cast<double>(count);
  int64_t step = 0;
  auto time_step = [&]() -> Result<double> {
    StepArgs a;
    a.step = ++step;
    a.hyper = {.lr = 1e-4, .weight_decay = 0.01};
    a.overflow_check = check;
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_ASSIGN_OR_RETURN(StepReport r, opt.step(a, s));
    const auto t1 = std::chrono::steady_clock::now();
    if (r.overflow) return Internal("bench cpu-adam: unexpected overflow in synthetic gradients");
    return std::chrono::duration<double>(t1 - t0).count();
  };
  auto time_probe = [&](bool prefetch, ProbeKind probe) -> Result<double> {
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(opt.stream_probe(s, prefetch, probe));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // 0: step; 1/2: streaming probe plain/prefetch; 3/4: conversion probe plain/prefetch.
  constexpr int kRuns = 5;
  auto time_run = [&](int which) -> Result<double> {
    if (which == 0) return time_step();
    return time_probe(which % 2 == 0, which <= 2 ? ProbeKind::kStreaming : ProbeKind::kConversion);
  };
  // Warm-up (page faults, TBB workers), then rotate the order every rep.
  for (int k = 0; k < kRuns; ++k) STRATA_RETURN_IF_ERROR(time_run(k).status());
  std::vector<double> times[kRuns];
  for (int rep = 0; rep < o.reps; ++rep) {
    for (int k = 0; k < kRuns; ++k) {
      const int which = (rep + k) % kRuns;
      STRATA_ASSIGN_OR_RETURN(double t, time_run(which));
      times[which].push_back(t);
    }
  }
  const double t_step = median(times[0]);
  const double t_stream_plain = median(times[1]), t_stream_prefetch = median(times[2]);
  const double t_conv_plain = median(times[3]), t_conv_prefetch = median(times[4]);
  const double params_per_s = static_cast<double>(count) / t_step;
  const double bytes_per_s = bytes / t_step;
  const double ceiling = bytes / std::min(t_stream_plain, t_stream_prefetch);
  const double conversion_ceiling = bytes / std::min(t_conv_plain, t_conv_prefetch);
  const double ratio = bytes_per_s / ceiling;
  const double conversion_ratio = bytes_per_s / conversion_ceiling;
  if (o.json) {
    nlohmann::json j;
    j["kernel"] = std::string(optimizer_kind_name(kind));
    j["threads"] = opt.threads();
    j["params"] = count;
    j["params_per_second"] = params_per_s;
    j["bytes_per_second"] = bytes_per_s;
    j["bytes_per_param"] = bpe;
    j["moment_dtype"] = int8 ? std::string("int8") : std::string(dtype_name(moment_dtype));
    j["out_of_place"] = o.out_of_place;
    if (int8) j["moment_block_elements"] = o.moment_block;
    j["ceiling_bytes_per_second"] = ceiling;  // streaming probe (no arithmetic)
    j["ratio"] = ratio;
    j["stream_probe_plain_bytes_per_second"] = bytes / t_stream_plain;
    j["stream_probe_prefetch_bytes_per_second"] = bytes / t_stream_prefetch;
    j["conversion_probe_bytes_per_second"] = conversion_ceiling;
    j["ratio_vs_conversion_probe"] = conversion_ratio;
    fmt::print("{}\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    return Status::Ok();
  }
  const std::string moments =
      int8 ? fmt::format("int8 (blocks of {})", o.moment_block) : std::string(dtype_name(moment_dtype));
  fmt::print("cpu-adam {}: {} params, grads {}, moments {}, param copy {}, overflow check {}{}\n",
             optimizer_kind_name(kind), format_count(count), dtype_name(grad_dtype), moments, o.param_copy,
             o.overflow_check, o.out_of_place ? ", out of place (state read from one set of buffers, written to another)" : "");
  fmt::print("  path {} ({}), {} thread(s), tiles of {} elements\n", kernel_path_name(opt.path()), opt.path_reason(),
             opt.threads(), opt.tile_elements());
  fmt::print("  access pattern: {:.4g} bytes per parameter (both probes move the same bytes)\n", bpe);
  fmt::print("  optimizer: {:.3f} Gparam/s  {:.2f} GB/s   (median of {}, {:.1f} ms per step)\n", params_per_s / 1e9,
             bytes_per_s / 1e9, o.reps, t_step * 1e3);
  fmt::print("  ceiling:   {:.2f} GB/s streaming probe: the same bytes, no arithmetic (plain loop {:.2f} GB/s, "
             "with prefetch {:.2f} GB/s)\n", ceiling / 1e9, bytes / t_stream_plain / 1e9,
             bytes / t_stream_prefetch / 1e9);
  fmt::print("  ratio:     {:.3f}  (bar: >= 0.95)\n", ratio);
  fmt::print("  second figure: conversion probe (dtype conversions + one add per stream) {:.2f} GB/s, "
             "ratio {:.3f}\n", conversion_ceiling / 1e9, conversion_ratio);
  return Status::Ok();
}

CommandRegistration bench_cpu_adam("bench cpu-adam", [](CLI::App& root) {
  CLI::App* bench = ensure_subcommand(root, "bench", "Benchmarks of Strata's kernels and engines");
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = bench->add_subcommand("cpu-adam", "CPU optimizer step vs a pure streaming probe of the same bytes");
  cmd->add_option("--params", o->params, "Parameters per step, e.g. 64M, 1e8")->capture_default_str();
  cmd->add_option("--threads", o->threads, "Worker threads (0 = all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--grad-dtype", o->grad_dtype, "fp32 | bf16 | fp16")->capture_default_str();
  cmd->add_option("--moment-dtype", o->moment_dtype, "fp32 | bf16 | int8 (block-wise 8-bit, adam/adamw)")
      ->capture_default_str();
  auto* moment_block = cmd->add_option("--moment-block", o->moment_block, "Elements per scale with --moment-dtype int8")
                           ->capture_default_str();
  cmd->add_option("--param-copy", o->param_copy, "none | bf16 | fp16: 16-bit param copy written in the same pass")
      ->capture_default_str();
  cmd->add_option("--kernel", o->kernel, "adam | adamw | adagrad | lion")->capture_default_str();
  cmd->add_option("--path", o->path, "auto | scalar | avx2 | avx512 | avx512_bf16")->capture_default_str();
  cmd->add_option("--overflow-check", o->overflow_check,
                  "assume-finite (finiteness known from the norm pass) | scan (the step reads grads first)")
      ->capture_default_str();
  cmd->add_flag("--out-of-place", o->out_of_place,
               "Read the state from one set of buffers and write it to another (as the engine's early updates do); "
               "the probes follow the same pattern");
  cmd->add_option("--reps", o->reps, "Timed repetitions of each (medians are reported)")->capture_default_str();
  cmd->add_flag("--json", o->json, "Print one JSON object");
  cmd->callback([o, moment_block] {
    o->moment_block_given = moment_block->count() > 0;
    Status st = run_bench(*o);
    if (!st.ok()) {
      fmt::print(stderr, "strata bench cpu-adam: {}\n", printable_message(st.to_string()));
      exit_with(1);
    }
    exit_with(0);
  });
});

}  // namespace
}  // namespace strata::cli
