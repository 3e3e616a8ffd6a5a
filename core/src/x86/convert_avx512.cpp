// AVX-512F bulk conversions (compiled with -mavx512f -mavx2 -mf16c), 16
// lanes per step; the same arithmetic as convert_avx2.cpp with mask
// registers, vpmovdw for the narrowing pack.
#include <immintrin.h>

#include "strata/core/dtype.h"
#include "x86/convert_kernels.h"

namespace strata::detail {
namespace {

inline __m512i bf16_round_avx512(__m512i x) {
  const __m512i high = _mm512_srli_epi32(x, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(is_nan, rounded, _mm512_or_si512(high, _mm512_set1_epi32(0x0040)));
}

void fp32_to_bf16(const float* src, uint16_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512i r = bf16_round_avx512(_mm512_loadu_si512(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
  for (; i < count; ++i) dst[i] = fp32_to_bf16_bits(src[i]);
}

void bf16_to_fp32(const uint16_t* src, float* dst, size_t count) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_si512(dst + i, _mm512_slli_epi32(wide, 16));
  }
  for (; i < count; ++i) dst[i] = bf16_bits_to_fp32(src[i]);
}

void fp32_to_fp16(const float* src, uint16_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
  for (; i < count; ++i) dst[i] = fp32_to_fp16_bits(src[i]);
}

void fp16_to_fp32(const uint16_t* src, float* dst, size_t count) {
  const __m512i exp_mask = _mm512_set1_epi32(0x7c00);
  const __m512i man_mask = _mm512_set1_epi32(0x03ff);
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m512 f = _mm512_cvtph_ps(h);
    // vcvtph2ps quiets signaling NaNs; the reference keeps the payload as is.
    const __m512i w = _mm512_cvtepu16_epi32(h);
    const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(w, exp_mask), exp_mask) &
                             _mm512_test_epi32_mask(w, man_mask);
    if (is_nan != 0) {
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x8000)), 16);
      const __m512i nan_bits = _mm512_or_si512(_mm512_or_si512(sign, _mm512_set1_epi32(0x7f800000)),
                                               _mm512_slli_epi32(_mm512_and_si512(w, man_mask), 13));
      f = _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_nan, _mm512_castps_si512(f), nan_bits));
    }
    _mm512_storeu_ps(dst + i, f);
  }
  for (; i < count; ++i) dst[i] = fp16_bits_to_fp32(src[i]);
}

}  // namespace

const ConvertKernels kConvertAvx512 = {fp32_to_bf16, bf16_to_fp32, fp32_to_fp16, fp16_to_fp32};

}  // namespace strata::detail
