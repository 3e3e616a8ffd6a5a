// Bulk dtype conversion: path selection by cpuid and dispatch.
#include "strata/core/dtype_convert.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "x86/convert_kernels.h"

namespace strata {
namespace detail {
namespace {

void scalar_fp32_to_bf16(const float* src, uint16_t* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = fp32_to_bf16_bits(src[i]);
}
void scalar_bf16_to_fp32(const uint16_t* src, float* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = bf16_bits_to_fp32(src[i]);
}
void scalar_fp32_to_fp16(const float* src, uint16_t* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = fp32_to_fp16_bits(src[i]);
}
void scalar_fp16_to_fp32(const uint16_t* src, float* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = fp16_bits_to_fp32(src[i]);
}

}  // namespace

const ConvertKernels kConvertScalar = {scalar_fp32_to_bf16, scalar_bf16_to_fp32, scalar_fp32_to_fp16,
                                       scalar_fp16_to_fp32};

}  // namespace detail

namespace {

using detail::ConvertKernels;

bool cpu_supports(ConvertPath path) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  switch (path) {
    case ConvertPath::kAuto:
    case ConvertPath::kScalar: return true;
    case ConvertPath::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case ConvertPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
    case ConvertPath::kAvx512Bf16:
      return cpu_supports(ConvertPath::kAvx512) && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return path == ConvertPath::kAuto || path == ConvertPath::kScalar;
#endif
}

const ConvertKernels& kernels_for(ConvertPath path) {
#if defined(__x86_64__) || defined(_M_X64)
  switch (path) {
    case ConvertPath::kAvx2: return detail::kConvertAvx2;
    case ConvertPath::kAvx512: return detail::kConvertAvx512;
    case ConvertPath::kAvx512Bf16: {
      static const ConvertKernels table = {detail::fp32_to_bf16_avx512bf16, detail::kConvertAvx512.bf16_to_fp32,
                                           detail::kConvertAvx512.fp32_to_fp16, detail::kConvertAvx512.fp16_to_fp32};
      return table;
    }
    default: break;
  }
#endif
  (void)path;
  return detail::kConvertScalar;
}

ConvertPath best_path() {
  for (ConvertPath p : {ConvertPath::kAvx512Bf16, ConvertPath::kAvx512, ConvertPath::kAvx2}) {
    if (cpu_supports(p)) return p;
  }
  return ConvertPath::kScalar;
}

// The chosen path: the environment's STRATA_CONVERT_PATH if valid and
// available, else the best one. Forced paths replace it.
std::atomic<ConvertPath>& active_slot() {
  static std::atomic<ConvertPath> slot = [] {
    ConvertPath chosen = best_path();
    if (const char* env = std::getenv("STRATA_CONVERT_PATH"); env != nullptr && *env != '\0') {
      auto parsed = parse_convert_path(env);
      if (parsed.ok() && *parsed != ConvertPath::kAuto && cpu_supports(*parsed)) chosen = *parsed;
    }
    return chosen;
  }();
  return slot;
}

const ConvertKernels& active_kernels() { return kernels_for(active_slot().load(std::memory_order_relaxed)); }

}  // namespace

std::string_view convert_path_name(ConvertPath path) {
  switch (path) {
    case ConvertPath::kAuto: return "auto";
    case ConvertPath::kScalar: return "scalar";
    case ConvertPath::kAvx2: return "avx2";
    case ConvertPath::kAvx512: return "avx512";
    case ConvertPath::kAvx512Bf16: return "avx512bf16";
  }
  return "?";
}

Result<ConvertPath> parse_convert_path(std::string_view name) {
  for (ConvertPath p : {ConvertPath::kAuto, ConvertPath::kScalar, ConvertPath::kAvx2, ConvertPath::kAvx512,
                        ConvertPath::kAvx512Bf16}) {
    if (name == convert_path_name(p)) return p;
  }
  return InvalidArgument(fmt::format("unknown conversion path '{}' (use auto, scalar, avx2, avx512 or avx512bf16)", name));
}

bool convert_path_available(ConvertPath path) { return cpu_supports(path); }

std::vector<ConvertPath> available_convert_paths() {
  std::vector<ConvertPath> out;
  for (ConvertPath p : {ConvertPath::kScalar, ConvertPath::kAvx2, ConvertPath::kAvx512, ConvertPath::kAvx512Bf16}) {
    if (cpu_supports(p)) out.push_back(p);
  }
  return out;
}

ConvertPath active_convert_path() { return active_slot().load(std::memory_order_relaxed); }

Status force_convert_path(ConvertPath path) {
  if (path == ConvertPath::kAuto) {
    active_slot().store(best_path(), std::memory_order_relaxed);
    return Status::Ok();
  }
  if (!cpu_supports(path))
    return Unsupported(fmt::format("conversion path '{}' is not supported by this CPU or build (available: {})",
                                   convert_path_name(path), [] {
                                     std::string names;
                                     for (ConvertPath p : available_convert_paths())
                                       names += (names.empty() ? "" : ", ") + std::string(convert_path_name(p));
                                     return names;
                                   }()));
  active_slot().store(path, std::memory_order_relaxed);
  return Status::Ok();
}

void convert_fp32_to_bf16(const float* src, bfloat16* dst, size_t count) {
  active_kernels().fp32_to_bf16(src, reinterpret_cast<uint16_t*>(dst), count);
}
void convert_bf16_to_fp32(const bfloat16* src, float* dst, size_t count) {
  active_kernels().bf16_to_fp32(reinterpret_cast<const uint16_t*>(src), dst, count);
}
void convert_fp32_to_fp16(const float* src, float16* dst, size_t count) {
  active_kernels().fp32_to_fp16(src, reinterpret_cast<uint16_t*>(dst), count);
}
void convert_fp16_to_fp32(const float16* src, float* dst, size_t count) {
  active_kernels().fp16_to_fp32(reinterpret_cast<const uint16_t*>(src), dst, count);
}

Status convert(const void* src, DType src_type, void* dst, DType dst_type, size_t count, ConvertPath path) {
  if (count == 0) return Status::Ok();
  if (src == nullptr || dst == nullptr) return InvalidArgument("convert: null source or destination");
  if (path == ConvertPath::kAuto) path = active_convert_path();
  if (!cpu_supports(path))
    return Unsupported(fmt::format("conversion path '{}' is not supported by this CPU or build", convert_path_name(path)));
  const ConvertKernels& k = kernels_for(path);
  if (src_type == dst_type) {
    std::memmove(dst, src, count * dtype_size(src_type));
    return Status::Ok();
  }
  const auto* s16 = static_cast<const uint16_t*>(src);
  auto* d16 = static_cast<uint16_t*>(dst);
  const auto* s32 = static_cast<const float*>(src);
  auto* d32 = static_cast<float*>(dst);
  if (src_type == DType::kF32 && dst_type == DType::kBF16) k.fp32_to_bf16(s32, d16, count);
  else if (src_type == DType::kBF16 && dst_type == DType::kF32) k.bf16_to_fp32(s16, d32, count);
  else if (src_type == DType::kF32 && dst_type == DType::kF16) k.fp32_to_fp16(s32, d16, count);
  else if (src_type == DType::kF16 && dst_type == DType::kF32) k.fp16_to_fp32(s16, d32, count);
  else
    return InvalidArgument(fmt::format("convert: {} -> {} is not supported; conversions are between fp32 and "
                                       "bf16/fp16 (go through fp32)", dtype_name(src_type), dtype_name(dst_type)));
  return Status::Ok();
}

}  // namespace strata
