// Bulk dtype conversion throughput per path, against a memcpy ceiling.
// Bytes counted = bytes read + bytes written (fp32->bf16 moves 6 bytes per
// element), the same way the memcpy ceiling counts (2 bytes per byte copied).
//   strata_bench_convert [--elements=N] [benchmark flags]
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "strata/core/dtype_convert.h"

namespace {

size_t g_elements = size_t{8} << 20;  // 32 MiB of fp32: past the caches
double g_memcpy_gbps = 0;

void BM_Convert(benchmark::State& state, strata::ConvertPath path, strata::DType from, strata::DType to) {
  const size_t n = g_elements;
  std::vector<char> src(n * strata::dtype_size(from)), dst(n * strata::dtype_size(to));
  std::mt19937 rng(1);
  auto* words = reinterpret_cast<uint16_t*>(src.data());
  for (size_t i = 0; i < src.size() / 2; ++i) words[i] = static_cast<uint16_t>(rng() & 0x7fff);  // finite values
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    strata::Status st = strata::convert(src.data(), from, dst.data(), to, n, path);
    if (!st.ok()) {
      state.SkipWithError(st.message().c_str());
      return;
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double bytes = static_cast<double>(src.size() + dst.size());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  // Percent of the memcpy ceiling (same read+write traffic), a plain number.
  const double gbps = bytes * static_cast<double>(state.iterations()) / seconds / 1e9;
  state.counters["pct_of_memcpy"] = gbps / g_memcpy_gbps * 100.0;
}

void BM_MemcpyCeiling(benchmark::State& state) {
  const size_t bytes = g_elements * 3;  // same read+write traffic as fp32->16-bit
  std::vector<char> a(bytes, 1), b(bytes, 2);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * bytes));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--elements=", 11) == 0) {
      g_elements = std::strtoull(argv[i] + 11, nullptr, 10);
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  g_memcpy_gbps = strata::bench::memcpy_read_write_gbps(g_elements * 3);
  std::printf("ceiling: memcpy of %zu bytes = %.2f GB/s (read + write), median of 7; active path: %s\n",
              g_elements * 3, g_memcpy_gbps, std::string(strata::convert_path_name(strata::active_convert_path())).c_str());
  benchmark::RegisterBenchmark("MemcpyCeiling", BM_MemcpyCeiling)->UseRealTime();
  using strata::DType;
  struct Pair { const char* name; DType from, to; };
  const Pair pairs[] = {{"fp32_to_bf16", DType::kF32, DType::kBF16}, {"bf16_to_fp32", DType::kBF16, DType::kF32},
                        {"fp32_to_fp16", DType::kF32, DType::kF16}, {"fp16_to_fp32", DType::kF16, DType::kF32}};
  for (const Pair& p : pairs) {
    for (strata::ConvertPath path : strata::available_convert_paths()) {
      const std::string name = std::string(p.name) + "/" + std::string(strata::convert_path_name(path));
      benchmark::RegisterBenchmark(name.c_str(), BM_Convert, path, p.from, p.to)->UseRealTime();
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
