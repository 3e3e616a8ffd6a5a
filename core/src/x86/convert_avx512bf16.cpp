// AVX-512 BF16 fp32->bf16 with vcvtne2ps2bf16 (compiled with -mavx512f
// -mavx512bw -mavx512bf16 -mavx2 -mf16c). The instruction rounds to nearest even and
// quiets NaNs like the reference, but treats fp32 subnormal inputs as zero
// (its DAZ behaviour); lanes holding a subnormal take the integer formula
// instead so the bits match dtype.h. The other conversions are those of
// the AVX-512F table.
#include <immintrin.h>

#include "strata/core/dtype.h"
#include "x86/convert_kernels.h"

namespace strata::detail {
namespace {

inline __m512i bf16_round_int(__m512i x) {
  const __m512i high = _mm512_srli_epi32(x, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
}

// Mask of lanes whose fp32 value is subnormal (exponent 0, mantissa != 0).
inline __mmask16 subnormal_lanes(__m512i x) {
  const __mmask16 exp_zero = _mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x7f800000));
  return exp_zero & _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x007fffff));
}

void fp32_to_bf16(const float* src, uint16_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m512 lo = _mm512_loadu_ps(src + i);
    const __m512 hi = _mm512_loadu_ps(src + i + 16);
    __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // same 512 bits, bf16 lanes
    const __mmask16 sub_lo = subnormal_lanes(_mm512_castps_si512(lo));
    const __mmask16 sub_hi = subnormal_lanes(_mm512_castps_si512(hi));
    if ((sub_lo | sub_hi) != 0) {
      const __m256i fix_lo = _mm512_cvtepi32_epi16(bf16_round_int(_mm512_castps_si512(lo)));
      const __m256i fix_hi = _mm512_cvtepi32_epi16(bf16_round_int(_mm512_castps_si512(hi)));
      const __m512i fixed = _mm512_inserti64x4(_mm512_castsi256_si512(fix_lo), fix_hi, 1);
      const __mmask32 lanes = static_cast<__mmask32>(sub_lo) | (static_cast<__mmask32>(sub_hi) << 16);
      packed = _mm512_mask_blend_epi16(lanes, packed, fixed);
    }
    _mm512_storeu_si512(dst + i, packed);
  }
  for (; i < count; ++i) dst[i] = fp32_to_bf16_bits(src[i]);
}

}  // namespace

void fp32_to_bf16_avx512bf16(const float* src, uint16_t* dst, size_t count) { fp32_to_bf16(src, dst, count); }

}  // namespace strata::detail
