#pragma once
// Which implementation of the optimizer kernels runs: the scalar reference
// or one of the x86 SIMD paths, chosen at run time by cpuid. The shipped
// build never uses -march=native; each SIMD path lives in its own source
// file compiled with its own flags (cpu_adam/src/x86/).

#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata::cpu_adam {

enum class KernelPath : uint8_t {
  kAuto = 0,     // the best path this CPU and build support
  kScalar,       // the readable reference loop (always available)
  kAvx2,         // AVX2 + FMA + F16C, 8 lanes
  kAvx512,       // AVX-512 F/BW/VL, 16 lanes; bf16 rounding in integer ops
  kAvx512Bf16,   // kAvx512 + AVX512-BF16 (vcvtneps2bf16) for bf16 stores
};

std::string_view kernel_path_name(KernelPath path);  // "scalar", "avx2", ...
// Accepts auto|scalar|avx2|avx512|avx512_bf16.
Result<KernelPath> parse_kernel_path(std::string_view name);

// True when this build contains the path and this CPU can run it.
bool kernel_path_supported(KernelPath path);
// Every concrete path (not kAuto) supported here, best last.
std::vector<KernelPath> supported_kernel_paths();

struct KernelPathChoice {
  KernelPath path = KernelPath::kScalar;
  std::string reason;  // "cpuid: avx512f avx512bw avx512vl avx512bf16", "forced by STRATA_CPU_ADAM_PATH=avx2"
};

// Resolves a request: kAuto picks the best supported path, unless the
// environment variable STRATA_CPU_ADAM_PATH names one. A concrete path that
// this machine or build cannot run is an error naming the missing feature.
Result<KernelPathChoice> resolve_kernel_path(KernelPath requested);

// Whether this library was built with the SIMD paths (CMake option
// STRATA_CPU_ADAM_SIMD).
bool simd_paths_built();

}  // namespace strata::cpu_adam
