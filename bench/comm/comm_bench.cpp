// Local-backend collectives against the ceiling they are bounded by: a
// memcpy of the same bytes by the same number of threads, measured in the
// same run. Counters: bytes_per_second is busbw-equivalent bytes for the
// collectives (nccl-tests factors) and bytes copied for memcpy.
//
//   build/bench/comm/strata_comm_bench --benchmark_repetitions=3
#include <benchmark/benchmark.h>

#include <cstring>
#include <thread>
#include <vector>

#include "strata/comm/backends.h"

namespace {

using strata::DType;
using strata::comm::Communicator;

constexpr int kIters = 30;

// Ceiling: `threads` threads each copying `bytes` (one rank's share).
void BM_MemcpyCeiling(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const auto bytes = static_cast<size_t>(state.range(1));
  std::vector<std::vector<char>> src(threads, std::vector<char>(bytes, 1));
  std::vector<std::vector<char>> dst(threads, std::vector<char>(bytes, 0));
  for (auto _ : state) {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back([&, t] { std::memcpy(dst[t].data(), src[t].data(), bytes); });
    std::memcpy(dst[0].data(), src[0].data(), bytes);
    for (auto& th : pool) th.join();
    benchmark::DoNotOptimize(dst[0].data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * threads * static_cast<int64_t>(bytes));
  state.SetLabel("aggregate bytes copied (ceiling)");
}

// op 0: all_gather (size = recv bytes), 1: all_reduce (size = buffer bytes).
void BM_LocalCollective(benchmark::State& state) {
  const int op = static_cast<int>(state.range(0));
  const int n = static_cast<int>(state.range(1));
  const auto bytes = static_cast<size_t>(state.range(2));
  auto group = strata::comm::create_local_group(n);
  if (!group.ok()) {
    state.SkipWithError(group.status().to_string().c_str());
    return;
  }
  auto& comms = *group;
  const size_t count = bytes / sizeof(float);
  std::vector<std::vector<float>> send(n), recv(n);
  for (int r = 0; r < n; ++r) {
    send[r].assign(op == 0 ? count / n : count, 1.0f);
    recv[r].assign(count, 0.0f);
  }
  auto run = [&](int r, int iterations) {
    for (int i = 0; i < iterations; ++i) {
      auto w = op == 0 ? comms[r]->all_gather(send[r].data(), recv[r].data(), count / n, DType::kF32)
                       : comms[r]->all_reduce(send[r].data(), recv[r].data(), count, DType::kF32);
      (void)w;
    }
    (void)comms[r]->synchronize();
  };
  std::vector<std::thread> peers;
  for (int r = 1; r < n; ++r) peers.emplace_back([&, r] { run(r, kIters); });
  int done = 0;
  for (auto _ : state) {
    auto w = op == 0 ? comms[0]->all_gather(send[0].data(), recv[0].data(), count / n, DType::kF32)
                     : comms[0]->all_reduce(send[0].data(), recv[0].data(), count, DType::kF32);
    (void)w->wait();
    ++done;
  }
  for (auto& p : peers) p.join();
  const double factor = op == 0 ? static_cast<double>(n - 1) / n : 2.0 * (n - 1) / n;
  state.SetBytesProcessed(static_cast<int64_t>(done * factor * static_cast<double>(bytes)));
  state.SetLabel(op == 0 ? "all_gather busbw" : "all_reduce busbw");
}

BENCHMARK(BM_MemcpyCeiling)->Args({1, 16 << 20})->Args({2, 16 << 20})->Iterations(kIters)->UseRealTime();
BENCHMARK(BM_LocalCollective)
    ->Args({0, 2, 64 << 20})
    ->Args({0, 4, 64 << 20})
    ->Args({1, 2, 64 << 20})
    ->Args({1, 4, 64 << 20})
    ->Iterations(kIters)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
