// Side-by-side driver: DeepSpeed's CPU Adam core (its Step_8 template,
// compiled by bench/cpu_adam/vs_deepspeed.sh from a DeepSpeed checkout with
// DeepSpeed's own CPU op-builder flags into ds_kernel.o, never committed
// here) against Strata's CpuOptimizer::step, in one process, on the same
// element count and thread count, in interleaved pairs (ABBA: even pairs run
// DeepSpeed first, odd pairs Strata first) so both see the same machine.
//
//   vs_deepspeed_driver --mix fp32|bf16 --threads T --params N --pairs K [--tile E] [--probes]
//
// fp32: both run AdamW on fp32 params, grads, m, v (28 B/param each).
// bf16: DeepSpeed's bf16-params path (bf16 params and grads, fp32 m and v:
//       22 B/param) against Strata's bf16 grads + fp32 master + fp32 m, v +
//       bf16 param copy written in the same pass (28 B/param).
// Prints every pair (ms, and Strata's params/s over DeepSpeed's), then the
// medians; --probes also times Strata's streaming probe after each pair.
// DeepSpeed runs on OpenMP (set OMP_WAIT_POLICY=passive so its idle threads
// do not spin against Strata's), Strata on its oneTBB arena.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/cpu_adam/optimizer.h"

extern "C" {
void* ds_create(float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw);
void ds_set_threads(int threads);
void ds_step_f32(void* opt, size_t step, float lr, float beta1, float beta2, float eps, float weight_decay,
                 float* params, float* grads, float* exp_avg, float* exp_avg_sq, size_t count);
void ds_step_bf16(void* opt, size_t step, float lr, float beta1, float beta2, float eps, float weight_decay,
                  uint16_t* params, uint16_t* grads, float* exp_avg, float* exp_avg_sq, size_t count);
}

namespace {

using namespace strata;
using namespace strata::cpu_adam;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <class T>
T* allocate(size_t n) {
  void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
  if (p == nullptr) {
    std::fprintf(stderr, "vs_deepspeed_driver: out of memory for %zu elements; use a smaller --params\n", n);
    std::exit(1);
  }
  return static_cast<T*>(p);
}

int usage(const char* why) {
  std::fprintf(stderr,
               "vs_deepspeed_driver: %s\nusage: vs_deepspeed_driver --mix fp32|bf16 --threads T --params N "
               "--pairs K [--tile E] [--probes]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mix = "fp32";
  int threads = 1, pairs = 8;
  size_t n = 64000000, tile = 65536;
  bool probes = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--probes") {
      probes = true;
      continue;
    }
    if (i + 1 >= argc) return usage(("missing value after " + a).c_str());
    const char* v = argv[++i];
    if (a == "--mix") mix = v;
    else if (a == "--threads") threads = std::atoi(v);
    else if (a == "--params") n = std::strtoull(v, nullptr, 10);
    else if (a == "--pairs") pairs = std::atoi(v);
    else if (a == "--tile") tile = std::strtoull(v, nullptr, 10);
    else return usage(("unknown option " + a).c_str());
  }
  if (mix != "fp32" && mix != "bf16") return usage("--mix must be fp32 or bf16");
  if (threads < 1 || pairs < 1 || n == 0) return usage("--threads, --pairs and --params must be >= 1");
  const bool bf16 = mix == "bf16";
  const float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.01f;

  // Separate state per optimizer (same values), so neither sees the other's updates.
  float* st_params = allocate<float>(n);
  float* st_m = allocate<float>(n);
  float* st_v = allocate<float>(n);
  float* ds_m = allocate<float>(n);
  float* ds_v = allocate<float>(n);
  float* grads32 = bf16 ? nullptr : allocate<float>(n);
  uint16_t* grads16 = bf16 ? allocate<uint16_t>(n) : nullptr;
  float* ds_params32 = bf16 ? nullptr : allocate<float>(n);
  uint16_t* ds_params16 = bf16 ? allocate<uint16_t>(n) : nullptr;
  uint16_t* st_copy = bf16 ? allocate<uint16_t>(n) : nullptr;
  uint32_t seed = 12345;
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const float r = static_cast<float>(seed >> 8) * (1.0f / 8388608.0f) - 1.0f;
    st_params[i] = r;
    st_m[i] = ds_m[i] = 0.0f;
    st_v[i] = ds_v[i] = 0.0f;
    if (bf16) {
      grads16[i] = fp32_to_bf16_bits(1e-3f * r);
      ds_params16[i] = fp32_to_bf16_bits(r);
      st_copy[i] = 0;
    } else {
      grads32[i] = 1e-3f * r;
      ds_params32[i] = r;
    }
  }

  ds_set_threads(threads);
  void* ds = ds_create(lr, beta1, beta2, eps, wd, /*adamw=*/true);
  auto opt = CpuOptimizer::create({.kind = OptimizerKind::kAdamW, .threads = threads, .tile_elements = tile});
  if (!opt.ok()) {
    std::fprintf(stderr, "vs_deepspeed_driver: %s\n", opt.status().to_string().c_str());
    return 1;
  }
  StateSpans state{.count = n, .params = st_params, .grads = bf16 ? static_cast<const void*>(grads16) : grads32,
                   .grad_dtype = bf16 ? DType::kBF16 : DType::kF32, .exp_avg = st_m, .exp_avg_sq = st_v,
                   .param_copy = st_copy, .param_copy_dtype = DType::kBF16};
  size_t ds_step = 0;
  int64_t st_step = 0;
  auto run_ds = [&] {
    const double t0 = now();
    if (bf16) ds_step_bf16(ds, ++ds_step, lr, beta1, beta2, eps, wd, ds_params16, grads16, ds_m, ds_v, n);
    else ds_step_f32(ds, ++ds_step, lr, beta1, beta2, eps, wd, ds_params32, grads32, ds_m, ds_v, n);
    return now() - t0;
  };
  auto run_strata = [&] {
    StepArgs a;
    a.step = ++st_step;
    a.hyper = {.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = wd};
    a.overflow_check = OverflowCheck::kAssumeFinite;  // as DeepSpeed: no overflow scan in the step
    const double t0 = now();
    auto r = opt->step(a, state);
    const double t = now() - t0;
    if (!r.ok()) {
      std::fprintf(stderr, "vs_deepspeed_driver: %s\n", r.status().to_string().c_str());
      std::exit(1);
    }
    return t;
  };
  auto run_probe = [&](bool prefetch) {
    const double t0 = now();
    if (!opt->stream_probe(state, prefetch, ProbeKind::kStreaming).ok()) std::exit(1);
    return now() - t0;
  };

  run_ds();  // warm-up: page faults, thread pools
  run_strata();
  std::printf("mix %s, %d thread(s), %zu params, Strata path %s, tiles %zu; bytes/param: Strata %zu, DeepSpeed %d\n",
              mix.c_str(), threads, n, std::string(kernel_path_name(opt->path())).c_str(), tile,
              CpuOptimizer::bytes_per_element(OptimizerKind::kAdamW, state), bf16 ? 22 : 28);
  std::printf("pair order DeepSpeed_ms Strata_ms Strata/DeepSpeed\n");
  std::vector<double> t_ds, t_st, ratio, t_plain, t_prefetch;
  for (int k = 0; k < pairs; ++k) {
    double a, b;
    if (k % 2 == 0) {
      a = run_ds();
      b = run_strata();
    } else {
      b = run_strata();
      a = run_ds();
    }
    t_ds.push_back(a);
    t_st.push_back(b);
    ratio.push_back(a / b);
    std::printf("%4d %s %9.1f %9.1f %7.3f\n", k, k % 2 == 0 ? "DS-ST" : "ST-DS", a * 1e3, b * 1e3, a / b);
    if (probes) {
      t_plain.push_back(run_probe(false));
      t_prefetch.push_back(run_probe(true));
    }
  }
  std::vector<double> sorted = ratio;
  std::sort(sorted.begin(), sorted.end());
  std::printf("median: DeepSpeed %.3f Gparam/s, Strata %.3f Gparam/s, Strata/DeepSpeed %.3f [min %.3f, max %.3f]\n",
              static_cast<double>(n) / median(t_ds) / 1e9, static_cast<double>(n) / median(t_st) / 1e9,
              median(ratio), sorted.front(), sorted.back());
  if (probes) {
    std::printf("Strata streaming probe: plain %.3f, prefetch %.3f Gparam/s\n",
                static_cast<double>(n) / median(t_plain) / 1e9, static_cast<double>(n) / median(t_prefetch) / 1e9);
  }
  return 0;
}
