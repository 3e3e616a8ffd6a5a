// Checksum cost and swap-store throughput with verification on and off.
// Ceiling: memcpy bandwidth of the same buffer (what any pass over the data
// costs at least); the swap benchmarks run on the directory given by
// STRATA_BENCH_DIR (default: /tmp), so their absolute numbers are the disk's.
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include <benchmark/benchmark.h>

#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/checksum.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_store.h"

namespace {

using namespace strata::nvme;

AlignedBuffer filled(size_t bytes) {
  AlignedBuffer b = std::move(AlignedBuffer::allocate(bytes, 4096)).value();
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    uint64_t x = rng();
    std::memcpy(b.data() + i, &x, 8);
  }
  return b;
}

void BM_MemcpyCeiling(benchmark::State& state) {
  size_t bytes = static_cast<size_t>(state.range(0));
  AlignedBuffer src = filled(bytes), dst = filled(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  state.SetLabel("ceiling: memcpy");
}

void BM_Xxh3Checksum(benchmark::State& state) {
  size_t bytes = static_cast<size_t>(state.range(0));
  AlignedBuffer src = filled(bytes);
  for (auto _ : state) benchmark::DoNotOptimize(checksum64(src.data(), bytes));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

BENCHMARK(BM_MemcpyCeiling)->Arg(1 << 20)->Arg(64 << 20);
BENCHMARK(BM_Xxh3Checksum)->Arg(1 << 20)->Arg(64 << 20);

std::string bench_dir() {
  const char* dir = std::getenv("STRATA_BENCH_DIR");
  return dir != nullptr ? dir : "/tmp";
}

// Reads one 64 MiB tensor back through the swap store; range(0) = verify.
void BM_SwapRead(benchmark::State& state) {
  bool verify = state.range(0) != 0;
  const uint64_t bytes = 64u << 20;
  IoEngineOptions o;
  o.queue_depth = 32;
  auto engine = make_io_engine(o);
  if (!engine.ok()) {
    state.SkipWithError(engine.status().to_string().c_str());
    return;
  }
  SwapStoreOptions so;
  so.paths = {bench_dir()};
  so.job = "bench-" + std::to_string(getpid());
  so.capacity_bytes = bytes;
  so.verify_checksums = verify;
  auto store = SwapStore::open(so, **engine);
  if (!store.ok()) {
    state.SkipWithError(store.status().to_string().c_str());
    return;
  }
  AlignedBuffer buf = filled(bytes);
  if (!(*store)->write_sync(1, buf.data(), bytes).ok()) {
    state.SkipWithError("write failed");
    return;
  }
  for (auto _ : state) {
    strata::Status st = (*store)->read_sync(1, buf.data(), bytes);
    if (!st.ok()) state.SkipWithError(st.to_string().c_str());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  state.SetLabel(verify ? "verify on" : "verify off");
}

BENCHMARK(BM_SwapRead)->Arg(0)->Arg(1)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
