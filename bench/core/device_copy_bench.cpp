// Device copy bandwidth, pinned vs pageable host memory, H2D and D2H, on
// the chosen backend (cpu: measures the copy engine threads; cuda: the
// PCIe/NVLink DMA engines). Each number is printed beside the host memcpy
// ceiling. Whether a "pinned" buffer really is pinned is reported (the pool
// falls back to pageable memory past RLIMIT_MEMLOCK).
//   strata_bench_device_copy [--device=cpu|cuda] [benchmark flags]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "strata/core/pinned_pool.h"

namespace {

std::unique_ptr<strata::Device> g_device;
std::unique_ptr<strata::PinnedPool> g_pool;

void BM_Copy(benchmark::State& state, strata::CopyKind kind, bool want_pinned) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  auto dev = g_device->allocate(bytes);
  auto stream = g_device->create_stream();
  if (!dev.ok() || !stream.ok()) {
    state.SkipWithError(dev.ok() ? stream.status().message().c_str() : dev.status().message().c_str());
    return;
  }
  strata::PinnedBuffer pinned;
  std::vector<char> pageable;
  void* host = nullptr;
  bool is_pinned = false;
  if (want_pinned) {
    auto buf = g_pool->allocate(bytes);
    if (!buf.ok()) {
      state.SkipWithError(buf.status().message().c_str());
      return;
    }
    pinned = std::move(buf).value();
    host = pinned.data();
    is_pinned = pinned.pinned();
  } else {
    pageable.resize(bytes);
    host = pageable.data();
  }
  std::memset(host, 1, bytes);
  // Touch the device buffer once so first-touch page faults (cpu device) or
  // lazy mapping are not timed.
  if (strata::Status st = g_device->memset(dev->data(), 0, bytes); !st.ok()) {
    state.SkipWithError(st.message().c_str());
    return;
  }
  for (auto _ : state) {
    strata::Status st = kind == strata::CopyKind::kHostToDevice
                            ? (*stream)->copy_async(dev->data(), host, bytes, kind)
                            : (*stream)->copy_async(host, dev->data(), bytes, kind);
    if (st.ok()) st = (*stream)->synchronize();
    if (!st.ok()) {
      state.SkipWithError(st.message().c_str());
      return;
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.SetLabel(want_pinned ? (is_pinned ? "pinned" : "pinned->pageable (RLIMIT_MEMLOCK fallback)") : "pageable");
}

}  // namespace

int main(int argc, char** argv) {
  std::string backend = "cpu";
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--device=", 9) == 0) {
      backend = argv[i] + 9;
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  strata::DeviceOptions options;
  options.device_memory_bytes = uint64_t{1} << 30;
  auto device = strata::make_device(backend, options);
  if (!device.ok()) {
    std::fprintf(stderr, "strata_bench_device_copy: %s\n", device.status().to_string().c_str());
    return 2;
  }
  g_device = std::move(device).value();
  strata::PinnedPoolOptions pool_options;
  pool_options.warn = [](std::string_view w) { std::fprintf(stderr, "warning: %.*s\n", static_cast<int>(w.size()), w.data()); };
  auto pool = strata::PinnedPool::create(g_device.get(), pool_options);
  if (!pool.ok()) {
    std::fprintf(stderr, "strata_bench_device_copy: %s\n", pool.status().to_string().c_str());
    return 2;
  }
  g_pool = std::move(pool).value();
  // Bytes moved per copy = size (a one-way transfer), so the ceiling here is
  // memcpy counted one way: half of its read+write rate.
  const double ceiling = strata::bench::memcpy_read_write_gbps(size_t{64} << 20) / 2;
  std::printf("device: %s (%s); ceiling: host memcpy 64 MiB = %.2f GB/s one-way, median of 7\n",
              g_device->caps().name.c_str(), backend.c_str(), ceiling);
  for (auto [kind, kind_name] : {std::pair{strata::CopyKind::kHostToDevice, "H2D"},
                                 std::pair{strata::CopyKind::kDeviceToHost, "D2H"}}) {
    for (bool pinned : {true, false}) {
      const std::string name = std::string(kind_name) + (pinned ? "/pinned" : "/pageable");
      benchmark::RegisterBenchmark(name.c_str(), BM_Copy, kind, pinned)
          ->Arg(256 << 10)->Arg(4 << 20)->Arg(64 << 20)->UseRealTime();
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  g_pool.reset();
  g_device.reset();
  return 0;
}
