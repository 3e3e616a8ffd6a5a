#pragma once
// AVX-512 F/BW/VL traits, 16 lanes; included by avx512.cpp (bf16 rounding
// with integer ops) and avx512_bf16.cpp (vcvtneps2bf16), selected by
// STRATA_CPU_ADAM_AVX512_BF16_INSN.
#include <immintrin.h>

#include "kernel_body.h"

namespace strata::cpu_adam::detail {

template <bool kBf16Insn>
struct Avx512 {
  using V = __m512;
  using D = __m512d;
  static constexpr size_t kWidth = 16;

  static V load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void stream_f32(float* p, V x) { _mm512_stream_ps(p, x); }  // 64-B aligned, non-temporal
  static V load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even; with the AVX512-BF16 instruction subnormal
  // inputs and outputs flush to zero; NaN -> (x >> 16) | 0x40 (quiet).
  static __m256i bf16_bits(V x) {
#if defined(STRATA_CPU_ADAM_AVX512_BF16_INSN)
    if constexpr (kBf16Insn) {
      const __m256bh h = _mm512_cvtneps_pbh(x);
      return reinterpret_cast<const __m256i&>(h);
    }
#endif
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet_nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
  }
  static void store_bf16(uint16_t* p, V x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x)); }
  static __m256i f16_bits(V x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, V x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f16_bits(x)); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, rounded once
  static V sign(V x) {
    const V zero = _mm512_setzero_ps();
    V r = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
  }

  // Raw streams for the streaming probe (Note [Streaming probe]).
  using R32 = __m512i;  // 16 x 32 bits
  using R16 = __m256i;  // 16 x 16 bits
  static R32 load_raw32(const void* p) { return _mm512_loadu_si512(p); }
  static void store_raw32(void* p, R32 x) { _mm512_storeu_si512(p, x); }
  static R16 load_raw16(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store_raw16(void* p, R16 x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }
  template <class R>
  static void keep(R& x) { asm volatile("" : "+v"(x)); }
  static R16 low16(R32 x) { return _mm512_cvtepi32_epi16(x); }  // vpmovdw: a shuffle, no arithmetic
  static void stream_raw16(void* p, R16 x) { _mm256_stream_si256(static_cast<__m256i*>(p), x); }  // 32-B aligned
  static void stream_raw32(void* p, R32 x) { _mm512_stream_si512(static_cast<__m512i*>(p), x); }  // 64-B aligned
  static void store_fence() { _mm_sfence(); }

  // 8-bit moments (kernel_body_int8.h).
  using VI = __m512i;
  static VI set1i(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static VI as_int(V x) { return _mm512_castps_si512(x); }
  static VI and_i(VI a, VI b) { return _mm512_and_si512(a, b); }
  static VI add_i(VI a, VI b) { return _mm512_add_epi32(a, b); }
  template <int S>
  static VI srli(VI a) { return _mm512_srli_epi32(a, S); }
  static VI min_u32(VI a, VI b) { return _mm512_min_epu32(a, b); }
  static VI max_u32(VI a, VI b) { return _mm512_max_epu32(a, b); }
  static void store_u8(uint8_t* p, VI x) {  // vpmovdb: lanes hold 0..255
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  // Four vectors of codes: four vpmovdb stores. (A two-pack-and-permute
  // store, as the AVX2 path does, was not measured on an AVX-512 machine.)
  static void store_u8x4(uint8_t* p, VI a, VI b, VI c, VI d) {
    store_u8(p, a);
    store_u8(p + kWidth, b);
    store_u8(p + 2 * kWidth, c);
    store_u8(p + 3 * kWidth, d);
  }
  static VI or_bit7(VI a, VI b) { return _mm512_or_si512(a, _mm512_and_si512(b, _mm512_set1_epi32(0x80))); }
  static uint32_t hmax_u32(VI x) { return _mm512_reduce_max_epu32(x); }
  // 16 codes -> 16 values (Note [Codes through fp16], kernel_body_int8.h).
  template <class Code, bool kSigned>
  static V load_codes(const uint8_t* p) {
    const __m256i code = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m256i half = _mm256_slli_epi16(code, 10 - Code::M);  // the magnitude's fp16 bits
    if constexpr (kSigned) {  // the sign (code bit 7, now bit 17 - M = 14) moves to bit 15
      half = _mm256_add_epi16(half, _mm256_and_si256(half, _mm256_set1_epi16(0x4000)));
    }
    return _mm512_cvtph_ps(half);
  }
  using R8 = __m128i;  // 16 x 8 bits
  static R8 load_raw8(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static void store_raw8(void* p, R8 x) { _mm_storeu_si128(static_cast<__m128i*>(p), x); }

  // The block scales: one scalar read and write per block.
  static float load_scale(const float* p) { return *static_cast<const volatile float*>(p); }
  static void store_scale(float* p, float x) { *static_cast<volatile float*>(p) = x; }

  static D zero_d() { return _mm512_setzero_pd(); }
  static void accumulate_squares(V x, D& lo_acc, D& hi_acc) {
    const D lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const D hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    lo_acc = _mm512_fmadd_pd(lo, lo, lo_acc);
    hi_acc = _mm512_fmadd_pd(hi, hi, hi_acc);
  }
  static double reduce_d(D x) {
    alignas(64) double lanes[8];
    _mm512_store_pd(lanes, x);
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
};

}  // namespace strata::cpu_adam::detail
