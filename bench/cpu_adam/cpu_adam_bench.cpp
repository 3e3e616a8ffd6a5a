// Google Benchmark microbenchmarks of the cpu_adam kernels: every path
// (scalar, avx2, avx512, avx512_bf16) x optimizer x dtype mix, single
// thread, on a working set larger than the caches, each beside the pure
// streaming probe that moves the same bytes with no arithmetic -- the
// ceiling it is compared against (bytes/s counters; "ceiling" rows are the
// probe, ProbeKind::kStreaming).
// Paths the CPU lacks are skipped. No timing is ever asserted. Wall-clock
// time (UseRealTime): the step is memory-bound, and on a shared machine
// CPU time would hide the time spent waiting for memory or a core.
//
//   strata_cpu_adam_bench --benchmark_filter='avx512/adamw'
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "strata/core/dtype.h"
#include "strata/cpu_adam/optimizer.h"

namespace {

using namespace strata;
using namespace strata::cpu_adam;

constexpr size_t kCount = 8u << 20;  // 8 Mi params: ~224 MiB of state for fp32 Adam

struct Mix {
  OptimizerKind kind;
  DType grad;
  DType moment;
  bool copy;
  bool int8 = false;  // block-wise 8-bit moments (blocks of kDefaultMomentBlockElements); moment unused
};

struct State {
  explicit State(const Mix& mix) : mix(mix) {
    params.assign(kCount, 0.5f);
    grads.assign(kCount * dtype_size(mix.grad), 0);
    for (size_t i = 0; i < kCount; ++i) {
      if (mix.grad == DType::kF32) reinterpret_cast<float*>(grads.data())[i] = 1e-3f;
      else if (mix.grad == DType::kBF16) reinterpret_cast<uint16_t*>(grads.data())[i] = fp32_to_bf16_bits(1e-3f);
      else reinterpret_cast<uint16_t*>(grads.data())[i] = fp32_to_fp16_bits(1e-3f);
    }
    m.assign(kCount * (mix.int8 ? 1 : dtype_size(mix.moment)), 0);
    v.assign(kCount * (mix.int8 ? 1 : dtype_size(mix.moment)), 0);
    copy.assign(kCount * 2, 0);
    m_scales.assign(moment_block_count(kCount, kDefaultMomentBlockElements), 0.0f);
    v_scales.assign(m_scales.size(), 0.0f);
  }
  StateSpans spans() {
    StateSpans s{.count = kCount, .params = params.data(), .grads = grads.data(), .grad_dtype = mix.grad,
                 .exp_avg = m.data(), .exp_avg_sq = v.data(), .moment_dtype = mix.moment,
                 .param_copy = mix.copy ? copy.data() : nullptr, .param_copy_dtype = DType::kBF16};
    if (mix.int8) {
      s.moment_format = MomentFormat::kBlockInt8;
      s.exp_avg_scale = m_scales.data();
      s.exp_avg_sq_scale = v_scales.data();
    }
    return s;
  }
  Mix mix;
  std::vector<float> params, m_scales, v_scales;
  std::vector<uint8_t> grads, m, v, copy;
};

void run(benchmark::State& bm, KernelPath path, Mix mix, bool probe) {
  if (!kernel_path_supported(path)) {
    bm.SkipWithError("kernel path not supported on this CPU");
    return;
  }
  auto opt = CpuOptimizer::create({.kind = mix.kind, .threads = 1, .path = path});
  if (!opt.ok()) {
    bm.SkipWithError(opt.status().to_string().c_str());
    return;
  }
  State s(mix);
  StateSpans spans = s.spans();
  int64_t step = 0;
  for (auto _ : bm) {
    if (probe) {
      if (!opt->stream_probe(spans).ok()) bm.SkipWithError("probe failed");
    } else {
      StepArgs a;
      a.step = ++step;
      a.overflow_check = OverflowCheck::kAssumeFinite;
      if (!opt->step(a, spans).ok()) bm.SkipWithError("step failed");
    }
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(CpuOptimizer::bytes_per_step(mix.kind, spans));
  bm.SetBytesProcessed(static_cast<int64_t>(bytes) * bm.iterations());
  bm.counters["params/s"] = benchmark::Counter(static_cast<double>(kCount) * bm.iterations(), benchmark::Counter::kIsRate);
}

void grad_stats(benchmark::State& bm, KernelPath path, DType grad) {
  if (!kernel_path_supported(path)) {
    bm.SkipWithError("kernel path not supported on this CPU");
    return;
  }
  auto opt = CpuOptimizer::create({.threads = 1, .path = path});
  State s(Mix{OptimizerKind::kAdamW, grad, DType::kF32, false});
  for (auto _ : bm) {
    auto r = opt->grad_stats(s.grads.data(), grad, kCount);
    benchmark::DoNotOptimize(r);
  }
  bm.SetBytesProcessed(static_cast<int64_t>(kCount * dtype_size(grad)) * bm.iterations());
}

int register_all() {
  const Mix mixes[] = {
      {OptimizerKind::kAdamW, DType::kF32, DType::kF32, false},
      {OptimizerKind::kAdamW, DType::kBF16, DType::kF32, true},
      {OptimizerKind::kAdamW, DType::kF16, DType::kF32, true},
      {OptimizerKind::kAdamW, DType::kBF16, DType::kBF16, true},
      {OptimizerKind::kAdamW, DType::kF32, DType::kF32, false, true},
      {OptimizerKind::kAdamW, DType::kBF16, DType::kF32, true, true},
      {OptimizerKind::kAdagrad, DType::kF32, DType::kF32, false},
      {OptimizerKind::kLion, DType::kBF16, DType::kF32, true},
  };
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512, KernelPath::kAvx512Bf16}) {
    for (const Mix& mix : mixes) {
      const std::string name = fmt::format("{}/{}/g_{}/m_{}/copy_{}", kernel_path_name(path),
                                           optimizer_kind_name(mix.kind), dtype_name(mix.grad),
                                           mix.int8 ? "int8" : dtype_name(mix.moment), mix.copy ? "bf16" : "none");
      benchmark::RegisterBenchmark((name + "/step").c_str(), run, path, mix, false)->Unit(benchmark::kMillisecond)->UseRealTime();
      benchmark::RegisterBenchmark((name + "/ceiling").c_str(), run, path, mix, true)->Unit(benchmark::kMillisecond)->UseRealTime();
    }
    for (DType g : {DType::kF32, DType::kBF16}) {
      benchmark::RegisterBenchmark(fmt::format("{}/grad_stats/g_{}", kernel_path_name(path), dtype_name(g)).c_str(),
                                   grad_stats, path, g)
          ->Unit(benchmark::kMillisecond)->UseRealTime();
    }
  }
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
