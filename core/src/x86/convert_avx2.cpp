// AVX2 + F16C bulk conversions (compiled with -mavx2 -mf16c).
// fp32->bf16 is integer arithmetic (round-to-nearest-even by bias, NaN
// quieted), exactly the scalar formula of dtype.h, 16 lanes per step;
// fp16 uses F16C's vcvtps2ph (RNE immediate) / vcvtph2ps, with a fix-up
// for signaling NaNs so the bits match the scalar reference.
#include <immintrin.h>

#include "strata/core/dtype.h"
#include "x86/convert_kernels.h"

namespace strata::detail {
namespace {

inline __m256i bf16_round_avx2(__m256i x) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  const __m256i high = _mm256_srli_epi32(x, 16);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(bias, _mm256_and_si256(high, one))), 16);
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), is_nan);
}

void fp32_to_bf16(const float* src, uint16_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i a = bf16_round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m256i b = bf16_round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  for (; i < count; ++i) dst[i] = fp32_to_bf16_bits(src[i]);
}

void bf16_to_fp32(const uint16_t* src, float* dst, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(wide, 16));
  }
  for (; i < count; ++i) dst[i] = bf16_bits_to_fp32(src[i]);
}

void fp32_to_fp16(const float* src, uint16_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < count; ++i) dst[i] = fp32_to_fp16_bits(src[i]);
}

void fp16_to_fp32(const uint16_t* src, float* dst, size_t count) {
  const __m256i exp_mask = _mm256_set1_epi32(0x7c00);
  const __m256i man_mask = _mm256_set1_epi32(0x03ff);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m256 f = _mm256_cvtph_ps(h);
    // vcvtph2ps quiets signaling NaNs; the reference keeps the payload as is.
    const __m256i w = _mm256_cvtepu16_epi32(h);
    const __m256i is_nan = _mm256_andnot_si256(
        _mm256_cmpeq_epi32(_mm256_and_si256(w, man_mask), _mm256_setzero_si256()),
        _mm256_cmpeq_epi32(_mm256_and_si256(w, exp_mask), exp_mask));
    if (!_mm256_testz_si256(is_nan, is_nan)) {
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16);
      const __m256i nan_bits = _mm256_or_si256(_mm256_or_si256(sign, _mm256_set1_epi32(0x7f800000)),
                                               _mm256_slli_epi32(_mm256_and_si256(w, man_mask), 13));
      f = _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_castps_si256(f), nan_bits, is_nan));
    }
    _mm256_storeu_ps(dst + i, f);
  }
  for (; i < count; ++i) dst[i] = fp16_bits_to_fp32(src[i]);
}

}  // namespace

const ConvertKernels kConvertAvx2 = {fp32_to_bf16, bf16_to_fp32, fp32_to_fp16, fp16_to_fp32};

}  // namespace strata::detail
