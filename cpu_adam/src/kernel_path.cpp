// Run-time choice of the kernel path by cpuid (__builtin_cpu_supports),
// overridable by request or by STRATA_CPU_ADAM_PATH.
#include "strata/cpu_adam/kernel_path.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include <fmt/format.h>

#include "kernels.h"

namespace strata::cpu_adam {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

// The CPU features a path needs, as cpuid names; empty when it needs none.
std::vector<std::string_view> required_features(KernelPath path) {
  switch (path) {
    case KernelPath::kAuto:
    case KernelPath::kScalar: return {};
    case KernelPath::kAvx2: return {"avx2", "fma", "f16c"};
    case KernelPath::kAvx512: return {"avx512f", "avx512bw", "avx512vl", "f16c"};
    case KernelPath::kAvx512Bf16: return {"avx512f", "avx512bw", "avx512vl", "f16c", "avx512bf16"};
  }
  return {};
}

bool cpu_has(std::string_view feature) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (feature == "avx2") return __builtin_cpu_supports("avx2");
  if (feature == "fma") return __builtin_cpu_supports("fma");
  if (feature == "f16c") return __builtin_cpu_supports("f16c");
  if (feature == "avx512f") return __builtin_cpu_supports("avx512f");
  if (feature == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (feature == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (feature == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
#endif
  return false;
}

std::vector<std::string_view> missing_features(KernelPath path) {
  std::vector<std::string_view> missing;
  for (std::string_view f : required_features(path))
    if (!cpu_has(f)) missing.push_back(f);
  return missing;
}

}  // namespace

std::string_view kernel_path_name(KernelPath path) {
  switch (path) {
    case KernelPath::kAuto: return "auto";
    case KernelPath::kScalar: return "scalar";
    case KernelPath::kAvx2: return "avx2";
    case KernelPath::kAvx512: return "avx512";
    case KernelPath::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

Result<KernelPath> parse_kernel_path(std::string_view name) {
  const std::string n = lower(name);
  for (KernelPath p : {KernelPath::kAuto, KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512,
                       KernelPath::kAvx512Bf16}) {
    if (n == kernel_path_name(p)) return p;
  }
  if (n == "avx512bf16" || n == "avx512-bf16") return KernelPath::kAvx512Bf16;
  return InvalidArgument(fmt::format(
      "unknown cpu_adam kernel path '{}'; expected one of auto, scalar, avx2, avx512, avx512_bf16", name));
}

bool simd_paths_built() { return STRATA_CPU_ADAM_SIMD != 0; }

bool kernel_path_supported(KernelPath path) {
  if (path == KernelPath::kAuto || path == KernelPath::kScalar) return true;
  return simd_paths_built() && missing_features(path).empty();
}

std::vector<KernelPath> supported_kernel_paths() {
  std::vector<KernelPath> out;
  for (KernelPath p : {KernelPath::kScalar, KernelPath::kAvx2, KernelPath::kAvx512, KernelPath::kAvx512Bf16})
    if (kernel_path_supported(p)) out.push_back(p);
  return out;
}

Result<KernelPathChoice> resolve_kernel_path(KernelPath requested) {
  std::string forced_by = "requested";
  if (requested == KernelPath::kAuto) {
    if (const char* env = std::getenv("STRATA_CPU_ADAM_PATH"); env != nullptr && *env != '\0') {
      auto parsed = parse_kernel_path(env);
      if (!parsed.ok()) return parsed.status().with_context("environment variable STRATA_CPU_ADAM_PATH");
      requested = *parsed;
      forced_by = fmt::format("forced by STRATA_CPU_ADAM_PATH={}", env);
    }
  }
  if (requested == KernelPath::kAuto) {
    const KernelPath best = supported_kernel_paths().back();
    std::string reason;
    if (!simd_paths_built()) {
      reason = "scalar-only build (STRATA_CPU_ADAM_SIMD=OFF)";
    } else if (best == KernelPath::kScalar) {
      reason = "cpuid: no avx2+fma+f16c";
    } else {
      reason = "cpuid:";
      for (std::string_view f : required_features(best)) reason += fmt::format(" {}", f);
      if (best == KernelPath::kAvx512) reason += " (no avx512bf16: bf16 rounding in integer ops)";
    }
    return KernelPathChoice{best, reason};
  }
  if (requested != KernelPath::kScalar && !simd_paths_built()) {
    return Unsupported(fmt::format(
        "cpu_adam kernel path '{}' is not in this build (built with STRATA_CPU_ADAM_SIMD=OFF); "
        "use 'scalar' or rebuild with -DSTRATA_CPU_ADAM_SIMD=ON", kernel_path_name(requested)));
  }
  const auto missing = missing_features(requested);
  if (!missing.empty()) {
    return Unsupported(fmt::format("cpu_adam kernel path '{}' needs CPU features this machine lacks: {}; "
                                   "use 'auto' or one of the supported paths",
                                   kernel_path_name(requested), fmt::join(missing, " ")));
  }
  return KernelPathChoice{requested, forced_by};
}

}  // namespace strata::cpu_adam
