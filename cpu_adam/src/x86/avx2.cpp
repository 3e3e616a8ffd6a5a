// AVX2 + FMA + F16C path, 8 lanes. Compiled with -mavx2 -mfma -mf16c
// (cpu_adam/CMakeLists.txt); only called after cpuid says the CPU has them.
// bf16 is widened with a shift and rounded to nearest even with integer
// ops (no scalar fallback, unlike DeepSpeed on AVX2); fp16 uses F16C.
#include <immintrin.h>

#include "kernel_body.h"

namespace strata::cpu_adam::detail {
namespace {

struct Avx2 {
  using V = __m256;
  using D = __m256d;
  static constexpr size_t kWidth = 8;

  static V load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void stream_f32(float* p, V x) { _mm256_stream_ps(p, x); }  // 32-B aligned, non-temporal
  static V load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even like fp32_to_bf16_bits: (x + 0x7fff + lsb) >> 16;
  // NaN -> (x >> 16) | 0x40 (quiet).
  static __m128i bf16_bits(V x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static void store_bf16(uint16_t* p, V x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
  static __m128i f16_bits(V x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, V x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f16_bits(x)); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, rounded once
  // +1, -1 or 0 (NaN -> 0; the step never sees NaN).
  static V sign(V x) {
    const V zero = _mm256_setzero_ps();
    const V pos = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const V neg = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
    return _mm256_or_ps(pos, neg);
  }

  // Raw streams for the streaming probe (Note [Streaming probe]).
  using R32 = __m256i;  // 8 x 32 bits
  using R16 = __m128i;  // 8 x 16 bits
  static R32 load_raw32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store_raw32(void* p, R32 x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }
  static R16 load_raw16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static void store_raw16(void* p, R16 x) { _mm_storeu_si128(static_cast<__m128i*>(p), x); }
  template <class R>
  static void keep(R& x) { asm volatile("" : "+x"(x)); }
  // The low 16 bits of each lane: two shuffles, no arithmetic.
  static R16 low16(R32 x) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, pick), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
  static void stream_raw16(void* p, R16 x) { _mm_stream_si128(static_cast<__m128i*>(p), x); }  // 16-B aligned
  static void stream_raw32(void* p, R32 x) { _mm256_stream_si256(static_cast<__m256i*>(p), x); }  // 32-B aligned
  static void store_fence() { _mm_sfence(); }

  // 8-bit moments (kernel_body_int8.h).
  using VI = __m256i;
  static VI set1i(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static VI as_int(V x) { return _mm256_castps_si256(x); }
  static VI and_i(VI a, VI b) { return _mm256_and_si256(a, b); }
  static VI add_i(VI a, VI b) { return _mm256_add_epi32(a, b); }
  template <int S>
  static VI srli(VI a) { return _mm256_srli_epi32(a, S); }
  static VI min_u32(VI a, VI b) { return _mm256_min_epu32(a, b); }
  static VI max_u32(VI a, VI b) { return _mm256_max_epu32(a, b); }
  static void store_u8(uint8_t* p, VI x) {  // lanes hold 0..255
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
  }
  // Four vectors of codes (0..255) -> 32 bytes in lane order.
  static void store_u8x4(uint8_t* p, VI a, VI b, VI c, VI d) {
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permutevar8x32_epi32(bytes, order));
  }
  static VI or_bit7(VI a, VI b) { return _mm256_or_si256(a, _mm256_and_si256(b, _mm256_set1_epi32(0x80))); }
  // 8 codes -> 8 values (Note [Codes through fp16], kernel_body_int8.h).
  template <class Code, bool kSigned>
  static V load_codes(const uint8_t* p) {
    const __m128i code = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m128i half = _mm_slli_epi16(code, 10 - Code::M);  // the magnitude's fp16 bits
    if constexpr (kSigned) {  // the sign (code bit 7, now bit 17 - M = 14) moves to bit 15
      half = _mm_add_epi16(half, _mm_and_si128(half, _mm_set1_epi16(0x4000)));
    }
    return _mm256_cvtph_ps(half);
  }
  static uint32_t hmax_u32(VI x) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }
  using R8 = __m128i;  // 8 x 8 bits in the low half
  static R8 load_raw8(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }
  static void store_raw8(void* p, R8 x) { _mm_storel_epi64(static_cast<__m128i*>(p), x); }

  // The block scales: one scalar read and write per block.
  static float load_scale(const float* p) { return *static_cast<const volatile float*>(p); }
  static void store_scale(float* p, float x) { *static_cast<volatile float*>(p) = x; }

  static D zero_d() { return _mm256_setzero_pd(); }
  static void accumulate_squares(V x, D& lo_acc, D& hi_acc) {
    const D lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const D hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lo_acc = _mm256_fmadd_pd(lo, lo, lo_acc);  // exact product: same as mul + add
    hi_acc = _mm256_fmadd_pd(hi, hi, hi_acc);
  }
  static double reduce_d(D x) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, x);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
};

}  // namespace

const KernelTable& avx2_kernels() { return Kernels<Avx2>::table(); }

}  // namespace strata::cpu_adam::detail
