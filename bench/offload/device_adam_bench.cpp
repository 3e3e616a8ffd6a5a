// The device optimizer kernel (offload/device_adam.h) on a cuda device: one
// fused Adam/AdamW step over a tensor of P parameters (bf16 gradients, a bf16
// parameter copy) with fp32, bf16 and block-wise 8-bit moments, against the
// ceiling of its own bytes: the bytes the step must read and write, moved at
// the device's device-to-device copy rate measured in the same run (a copy of
// S bytes reads and writes 2 S). Without a usable GPU it says so and exits 0.
//   strata_device_adam_bench [--params=N] [benchmark flags]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "strata/cpu_adam/moment_storage.h"
#include "strata/offload/device_adam.h"

namespace {

using strata::cpu_adam::MomentStorage;

std::unique_ptr<strata::Device> g_device;
std::unique_ptr<strata::Stream> g_stream;
size_t g_params = size_t{64} << 20;
double g_copy_bytes_per_second = 0.0;  // device-to-device, read + write

// Bytes one step moves per parameter: fp32 master read and written, the bf16
// gradient read, both moments read and written (8-bit: codes and the block
// scales), the bf16 copy written.
double step_bytes(const MomentStorage& moments, size_t params) {
  const double moment = static_cast<double>(moments.moment_bytes(params));
  return static_cast<double>(params) * (4 + 4 + 2 + 2) + 2 * 2 * moment;
}

// Bytes read + written per second by a device-to-device copy of `bytes`,
// the median of `reps` synchronized copies (0 when a copy fails).
double copy_rate(size_t bytes, int reps) {
  auto a = g_device->allocate(bytes), b = g_device->allocate(bytes);
  if (!a.ok() || !b.ok()) return 0.0;
  std::vector<double> rates;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    strata::Status st = g_stream->copy_async(b->data(), a->data(), bytes, strata::CopyKind::kDeviceToDevice);
    if (st.ok()) st = g_stream->synchronize();
    if (!st.ok()) return 0.0;
    rates.push_back(2.0 * static_cast<double>(bytes) /
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

void BM_DeviceAdam(benchmark::State& state, MomentStorage moments) {
  const size_t n = g_params;
  auto params = g_device->allocate(n * 4), grads = g_device->allocate(n * 2), copy = g_device->allocate(n * 2);
  auto m = g_device->allocate(moments.moment_bytes(n)), v = g_device->allocate(moments.moment_bytes(n));
  for (auto* b : {&params, &grads, &copy, &m, &v}) {
    if (!b->ok()) {
      state.SkipWithError(b->status().message().c_str());
      return;
    }
  }
  // Zero state (8-bit: codes and scales 0) and a constant bf16 gradient 0x3c3c (~0.0115).
  for (auto* b : {&params, &copy, &m, &v}) (void)g_device->memset((*b)->data(), 0, (*b)->size_bytes());
  (void)g_device->memset(grads->data(), 0x3c, n * 2);
  strata::offload::DeviceAdamArgs args;
  args.kind = strata::cpu_adam::OptimizerKind::kAdamW;
  args.hyper = {.lr = 1e-4, .weight_decay = 0.01};
  args.grad_dtype = strata::DType::kBF16;
  args.moments = moments;
  args.param_copy_dtype = strata::DType::kBF16;
  const strata::offload::DeviceAdamTensor tensor{params->as<float>(), grads->data(), m->data(), v->data(),
                                                copy->data(), n};
  int64_t step = 0;
  for (auto _ : state) {
    args.step = ++step;
    const auto t0 = std::chrono::steady_clock::now();
    strata::Status st = strata::offload::device_adam_step(*g_stream, args, {&tensor, 1});
    if (st.ok()) st = g_stream->synchronize();
    if (!st.ok()) {
      state.SkipWithError(st.message().c_str());
      return;
    }
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double bytes = step_bytes(moments, n);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["Gparam/s"] = benchmark::Counter(static_cast<double>(state.iterations() * n) / 1e9,
                                                  benchmark::Counter::kIsRate);
  state.counters["bytes/param"] = bytes / static_cast<double>(n);
  // Ceiling of this step: its bytes at the device's copy rate; the ratio is
  // the rate this step reached over that rate.
  state.counters["ceiling_GB/s"] = g_copy_bytes_per_second / 1e9;
  state.counters["ratio"] =
      benchmark::Counter(bytes / g_copy_bytes_per_second, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(moments.name()) + " moments");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--params=", 9) == 0) {
      char* end = nullptr;
      const unsigned long long p = std::strtoull(argv[i] + 9, &end, 10);
      if (end == argv[i] + 9 || *end != '\0' || p == 0 || p > (1ull << 34)) {
        std::fprintf(stderr, "strata_device_adam_bench: --params=%s: expected a count from 1 to 2^34\n", argv[i] + 9);
        return 2;
      }
      g_params = static_cast<size_t>(p);
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  auto device = strata::make_device("cuda");
  if (!device.ok()) {
    std::printf("strata_device_adam_bench: no usable cuda device (%s); nothing measured\n",
                device.status().message().c_str());
    return 0;
  }
  g_device = std::move(device).value();
  auto stream = g_device->create_stream();
  if (!stream.ok()) {
    std::fprintf(stderr, "strata_device_adam_bench: %s\n", stream.status().to_string().c_str());
    return 2;
  }
  g_stream = std::move(stream).value();
  g_copy_bytes_per_second = copy_rate(size_t{512} << 20, 9);
  if (g_copy_bytes_per_second <= 0.0) {
    std::fprintf(stderr, "strata_device_adam_bench: the device-to-device copy ceiling could not be measured\n");
    return 2;
  }
  std::printf("device: %s; %zu parameters; ceiling: device-to-device copy of 512 MiB = %.1f GB/s (read + write), "
              "median of 9\n",
              g_device->caps().name.c_str(), g_params, g_copy_bytes_per_second / 1e9);
  for (const MomentStorage& moments : {MomentStorage::fp32(), MomentStorage::bf16(), MomentStorage::int8()}) {
    const std::string name = "device_adam/adamw/g_bf16/copy_bf16/m_" + std::string(moments.name());
    benchmark::RegisterBenchmark(name.c_str(), BM_DeviceAdam, moments)->UseManualTime()->Iterations(20);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  g_stream.reset();
  g_device.reset();
  return 0;
}
