// The ceiling the model's CPU throughput is compared against: this
// machine's sgemm rate (OpenBLAS through cpu::gemm) on the shapes a
// training step of the `small` preset uses, beside a full
// forward+backward step of the model at the same shapes. Achieved GFLOP/s
// of the step / sgemm GFLOP/s = the fraction of peak the model reaches.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <vector>

#include "strata/core/device_registry.h"
#include "strata/model/cpu_ops.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/rng.h"
#include "strata/offload/resident_provider.h"

namespace {

using namespace strata::model;

std::vector<float> filled(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

// Row-major out[M,N] = A[M,K] @ B[N,K]^T, as matmul_forward does.
void BM_Sgemm(benchmark::State& state) {
  const int M = static_cast<int>(state.range(0)), N = static_cast<int>(state.range(1)),
            K = static_cast<int>(state.range(2));
  auto A = filled(static_cast<size_t>(M) * K, 1), B = filled(static_cast<size_t>(N) * K, 2);
  std::vector<float> C(static_cast<size_t>(M) * N);
  for (auto _ : state) {
    cpu::gemm<float>(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N);
    benchmark::DoNotOptimize(C.data());
  }
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * M * N * K, benchmark::Counter::kIsIterationInvariantRate,
                                                benchmark::Counter::kIs1000);
}
// small preset, B=8 T=256: N = 2048 rows, C = 512.
BENCHMARK(BM_Sgemm)->Args({2048, 1536, 512})->Args({2048, 2048, 512})->Args({2048, 512, 2048})
    ->Args({2048, 256, 512})->Args({1024, 1024, 1024})->Unit(benchmark::kMillisecond)->UseRealTime();

// One forward + backward of a GPT at (preset, B, T) on the cpu device.
void BM_TrainStep(benchmark::State& state, const char* name, int B, int T) {
  auto model = GptModel::create(preset(name).value(), 1).value();
  strata::MemoryStats host_stats;
  auto params = strata::offload::ResidentProvider::create(*model, host_stats).value();
  strata::DeviceOptions options;
  options.device_memory_bytes = uint64_t{8} << 30;
  auto device = strata::make_device("cpu", options).value();
  auto stream = device->create_stream().value();
  auto exec = GptExecutor::create(*model, *device, *stream, B, T).value();
  std::vector<int32_t> tok(static_cast<size_t>(B) * T), tgt(tok.size());
  Rng rng(3);
  for (auto& t : tok) t = static_cast<int32_t>(rng.below(256));
  for (auto& t : tgt) t = static_cast<int32_t>(rng.below(256));
  for (auto _ : state) {
    benchmark::DoNotOptimize(exec->forward(tok, tgt, *params).value());
    if (!exec->backward(1.0f, *params).ok() || !params->wait_gradients().ok())
      state.SkipWithError("backward failed");
  }
  const double flops = model->config().train_flops_per_token(T) * B * T;
  state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate,
                                                benchmark::Counter::kIs1000);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(B) * T,
                                                  benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_TrainStep, tiny_b8_t64, "tiny", 8, 64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_TrainStep, small_b8_t256, "small", 8, 256)->Unit(benchmark::kMillisecond)->UseRealTime()
    ->MinTime(5.0);

}  // namespace

int main(int argc, char** argv) {
  std::printf("Ceiling: BM_Sgemm FLOP/s (OpenBLAS sgemm on this machine, training-step shapes).\n"
              "BM_TrainStep FLOP/s counts 6*params + attention FLOPs per token; its ratio to the\n"
              "sgemm rate is the fraction of the machine's matmul peak the model reaches.\n");
  std::printf("matmul: %s\n", cpu::gemm_backend_description().c_str());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
