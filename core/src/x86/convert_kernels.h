#pragma once
// Internal: per-ISA bulk conversion kernels, one table per file in x86/
// (each compiled with its own -m flags). Every kernel handles any count:
// the SIMD body plus a scalar tail through dtype.h.
#include <cstddef>
#include <cstdint>

namespace strata::detail {

struct ConvertKernels {
  void (*fp32_to_bf16)(const float* src, uint16_t* dst, size_t count);
  void (*bf16_to_fp32)(const uint16_t* src, float* dst, size_t count);
  void (*fp32_to_fp16)(const float* src, uint16_t* dst, size_t count);
  void (*fp16_to_fp32)(const uint16_t* src, float* dst, size_t count);
};

extern const ConvertKernels kConvertScalar;
#if defined(__x86_64__) || defined(_M_X64)
extern const ConvertKernels kConvertAvx2;        // AVX2 + F16C
extern const ConvertKernels kConvertAvx512;      // AVX-512F (F16C-style conversions)
// AVX-512F/BW + AVX512_BF16 vcvtne2ps2bf16; the other directions use kConvertAvx512.
void fp32_to_bf16_avx512bf16(const float* src, uint16_t* dst, size_t count);
#endif

}  // namespace strata::detail
