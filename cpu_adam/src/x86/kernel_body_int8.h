#pragma once
// The SIMD kernels for 8-bit moments (Note [Block-wise 8-bit moments],
// int8_moments.cpp), over the same ISA traits as kernel_body.h; included at
// its end. Adam/AdamW only (validate_state refuses the others).
//
// Per block of B elements: (1) decode each vector's codes with the block's
// old scales, run Note [Update formulas] with u = sqrt(v), store params and
// the copy, keep m and u in an L1-resident stack buffer and their running
// maxima (an unsigned max of the bits with the sign cleared, exact); (2) the
// new scales and 1 / scale once per block in scalar code (int8_format.h);
// (3) encode the buffer to codes. Every lane performs the integer and float
// operations of int8_format.h, so codes and scales equal the reference's.
//
// Extra traits used here: VI (32-bit integer lanes), set1i, as_int, and_i,
// add_i, srli<S>, min_u32, max_u32, store_u8 (one byte per lane,
// truncated), store_u8x4 (four vectors' lanes, 0..255, as 4W consecutive
// bytes), or_bit7 (a | (b & 0x80)), load_codes<Code, signed> (one vector of
// codes decoded, Note [Codes through fp16]), hmax_u32, load_scale /
// store_scale; for the streaming probe R8 with load_raw8 / store_raw8.
#include <algorithm>
#include <bit>

#include "../int8_format.h"
#include "strata/cpu_adam/int8_moments.h"

namespace strata::cpu_adam::detail {

template <class I>
struct Int8Kernels {
  using K = Kernels<I>;
  using V = typename I::V;
  using VI = typename I::VI;
  using Pass = typename K::Pass;
  using Consts = typename K::Consts;
  static constexpr size_t W = I::kWidth;

  // Note [Codes from fp32's lowest binades] (int8_format.h): scaled by
  // 2^-112, the value's bits rounded to M mantissa bits are the code, normal
  // or subnormal. kNonNegative: r is +0, positive or NaN (sqrt(v) / scale),
  // so the sign mask is skipped (a NaN with its sign set is a huge unsigned
  // value, clamped by the min like the cleared NaN).
  template <class Code, bool kNonNegative = false>
  static VI encode(V r) {
    constexpr int M = Code::M;
    const VI scaled = I::as_int(I::mul(r, I::set1(Code::kDownscale)));
    const VI a = kNonNegative ? scaled : I::and_i(scaled, I::set1i(0x7fffffffu));
    const VI q = I::template srli<23 - M>(I::add_i(a, I::set1i(Code::kRoundHalf)));
    return I::min_u32(q, I::set1i(Code::kMaxCode));
  }
  // One vector of codes <-> values (unscaled: m / scale, sqrt(v) / scale).
  // Decoding goes through the fp16 conversion (Note [Codes through fp16]);
  // encoding performs the integer and float operations of int8_format.h.
  static V load_m(const uint8_t* codes) { return I::template load_codes<ExpAvgCode, true>(codes); }
  static V load_u(const uint8_t* codes) { return I::template load_codes<ExpAvgSqCode, false>(codes); }
  // r = m / scale; its sign is m's (1 / scale is +0 or positive).
  static VI m_codes(V r) { return I::or_bit7(encode<ExpAvgCode>(r), I::template srli<24>(I::as_int(r))); }
  // The update's r = sqrt(v) / scale is never negative; the conversion probe's may be.
  static VI u_codes(V r) { return encode<ExpAvgSqCode, true>(r); }
  static void store_m(uint8_t* codes, V r) { I::store_u8(codes, m_codes(r)); }
  static void store_u_any_sign(uint8_t* codes, V r) { I::store_u8(codes, encode<ExpAvgSqCode>(r)); }

  // Note [Codes through fp16]: a code's magnitude bits, shifted left by
  // 10 - M, are the fp16 bits of code-value / 1.0 exactly: 4 exponent bits
  // with bias 15 and M mantissa bits are the low end of fp16's 5-bit
  // exponent (the largest code, 15 << M, is fp16 1.0), and the code's
  // subnormals (q < 2^M, q * 2^(-14-M)) are fp16's subnormals. So one
  // vcvtph2ps decodes 16 codes, subnormals included, to the same floats as
  // the reference's integer formula (int8_format.h): a shift and, for the
  // signed first moment, moving bit 7 to fp16's sign bit, on 16-bit lanes.
  // Encoding the same way (vcvtps2ph, then rounding to M bits) rounds
  // twice; made exact by rounding to odd first it was slower than the
  // integer path on Zen 4 (measured, docs/cpu_adam.md), so encoding stays
  // on 32-bit lanes.

  // Pointers for one vector at index i of the tile (or of a padded copy);
  // the update reads the *_in ones (Kernels::Block), the probes run in place.
  struct Vec {
    float* params;
    const void* grads;
    uint8_t* m_codes;
    uint8_t* v_codes;
    void* param_copy;
    bool copy_non_temporal;
    const float* params_in;
    const uint8_t* m_codes_in;
    const uint8_t* v_codes_in;
  };
  // Per block: old scales (broadcast), 1 / scale (conversion probe only), running maxima.
  struct BlockState {
    V m_scale, u_scale, m_inv, u_inv;
    VI m_max, u_max;
    float* m_buf;  // the block's new m and u, by offset in the block
    float* u_buf;
  };

  template <DType G, CopyType C>
  static inline void update_vec(const Consts& c, const Vec& b, size_t i, BlockState& s, size_t j) {
    V p = I::load_f32(b.params_in + i);
    V g = I::mul(K::template load<G>(b.grads, i), c.grad_multiplier);
    V m = I::mul(load_m(b.m_codes_in + i), s.m_scale);
    const V u_old = I::mul(load_u(b.v_codes_in + i), s.u_scale);
    V v = I::mul(u_old, u_old);
    if (c.l2_decay) g = I::fmadd(c.weight_decay, p, g);
    m = I::fmadd(c.one_minus_beta1, I::sub(g, m), m);
    v = I::fmadd(I::mul(c.one_minus_beta2, g), g, I::mul(v, c.beta2));
    const V u = I::sqrt(v);
    const V denom = I::fmadd(u, c.inv_bias_correction2_sqrt, c.eps);
    if (c.decoupled_decay) p = I::mul(p, c.decay_factor);
    p = I::fmadd(c.neg_step_size, I::div(m, denom), p);
    I::store_f32(b.params + i, p);
    K::template store_copy<C>(b.param_copy, i, p, b.copy_non_temporal);
    I::store_f32(s.m_buf + j, m);
    I::store_f32(s.u_buf + j, u);
    s.m_max = I::max_u32(s.m_max, I::and_i(I::as_int(m), I::set1i(0x7fffffffu)));
    s.u_max = I::max_u32(s.u_max, I::and_i(I::as_int(u), I::set1i(0x7fffffffu)));
  }

  // The conversion probe: decode, one add, encode with the same scale.
  template <DType G, CopyType C>
  static inline void probe_vec(const Consts&, const Vec& b, size_t i, BlockState& s, size_t) {
    const V g = K::template load<G>(b.grads, i);
    const V p = I::add(I::load_f32(b.params_in + i), g);
    I::store_f32(b.params + i, p);
    const V m = I::mul(load_m(b.m_codes_in + i), s.m_scale);
    store_m(b.m_codes + i, I::mul(I::add(m, g), s.m_inv));
    const V u = I::mul(load_u(b.v_codes_in + i), s.u_scale);
    store_u_any_sign(b.v_codes + i, I::mul(I::add(u, g), s.u_inv));
    K::template store_copy<C>(b.param_copy, i, p, b.copy_non_temporal);
  }

  // The streaming probe (Note [Streaming probe]): raw bytes, no arithmetic.
  template <DType G, CopyType C>
  static inline void stream_vec(const Consts&, const Vec& b, size_t i, BlockState&, size_t) {
    auto p = I::load_raw32(reinterpret_cast<const char*>(b.params_in) + i * 4);
    if constexpr (G == DType::kF32) {
      auto g = I::load_raw32(static_cast<const char*>(b.grads) + i * 4);
      I::keep(g);
    } else {
      auto g = I::load_raw16(static_cast<const char*>(b.grads) + i * 2);
      I::keep(g);
    }
    auto m = I::load_raw8(b.m_codes_in + i);
    auto v = I::load_raw8(b.v_codes_in + i);
    I::keep(m);
    I::keep(v);
    I::store_raw8(b.m_codes + i, m);
    I::store_raw8(b.v_codes + i, v);
    I::keep(p);
    I::store_raw32(reinterpret_cast<char*>(b.params) + i * 4, p);
    if constexpr (C != CopyType::kNone) K::store_copy_bits(b.param_copy, i, I::low16(p), b.copy_non_temporal);
  }

  template <Pass P, DType G, CopyType C>
  static inline void do_vec(const Consts& c, const Vec& b, size_t i, BlockState& s, size_t j) {
    if constexpr (P == Pass::kProbe) probe_vec<G, C>(c, b, i, s, j);
    else if constexpr (P == Pass::kStream) stream_vec<G, C>(c, b, i, s, j);
    else update_vec<G, C>(c, b, i, s, j);
  }

  template <Pass P, DType G, CopyType C>
  static void run(const StepFactors& f, const TileSpans& t) {
    const Consts c(f);
    const bool non_temporal = C != CopyType::kNone && f.copy_non_temporal &&
                              reinterpret_cast<uintptr_t>(t.param_copy) % (W * 2) == 0;
    const Vec b{t.params,
                t.grads,
                static_cast<uint8_t*>(t.exp_avg),
                static_cast<uint8_t*>(t.exp_avg_sq),
                t.param_copy,
                non_temporal,
                t.params_in,
                static_cast<const uint8_t*>(t.exp_avg_in),
                static_cast<const uint8_t*>(t.exp_avg_sq_in)};
    // One array, the two halves 64 bytes off a multiple of 4 KiB apart, so that
    // m_buf[j] and u_buf[j] never look alike to the 4K-aliasing check of loads.
    alignas(64) float buffers[2 * kMaxMomentBlockElements + 16];
    float* const m_buf = buffers;
    float* const u_buf = buffers + kMaxMomentBlockElements + 16;
    const size_t ahead = P != Pass::kUpdate && !f.probe_prefetch ? 0 : prefetch_elements();
    const size_t block = t.block_elements;
    for (size_t begin = 0, index = 0; begin < t.count; begin += block, ++index) {
      const size_t n = std::min(block, t.count - begin);
      float* m_scale = t.exp_avg_scale + index;  // one read and one write per block in every pass
      float* u_scale = t.exp_avg_sq_scale + index;
      const float m_old = I::load_scale(t.exp_avg_scale_in + index), u_old = I::load_scale(t.exp_avg_sq_scale_in + index);
      BlockState s{};
      if constexpr (P == Pass::kUpdate) {
        s = BlockState{I::set1(m_old), I::set1(u_old), I::set1(0.0f), I::set1(0.0f), I::set1i(0), I::set1i(0),
                       m_buf, u_buf};
      } else if constexpr (P == Pass::kProbe) {  // encodes with the old scales
        s = BlockState{I::set1(m_old), I::set1(u_old), I::set1(inverse_scale(m_old)), I::set1(inverse_scale(u_old)),
                       I::set1i(0), I::set1i(0), m_buf, u_buf};
      }
      size_t j = 0;
      for (; j + W <= n; j += W) {
        if (ahead != 0) prefetch_vec(b, begin + j + ahead);
        do_vec<P, G, C>(c, b, begin + j, s, j);
      }
      if (j < n) tail<P, G, C>(c, b, begin + j, n - j, s, j);
      if constexpr (P == Pass::kUpdate) {
        const float m_new = std::bit_cast<float>(I::hmax_u32(s.m_max));
        const float u_new = std::bit_cast<float>(I::hmax_u32(s.u_max));
        encode_block<G>(b, begin, n, t.count, m_buf, u_buf, I::set1(inverse_scale(m_new)),
                        I::set1(inverse_scale(u_new)));
        I::store_scale(m_scale, m_new);
        I::store_scale(u_scale, u_new);
      } else {
        I::store_scale(m_scale, m_old);
        I::store_scale(u_scale, u_old);
      }
    }
    if (non_temporal) I::store_fence();
  }

  static inline void prefetch_vec(const Vec& b, size_t j) {
    K::prefetch(b.params_in, j * 4);
    K::prefetch(b.m_codes_in, j);
    K::prefetch(b.v_codes_in, j);
  }

  // The last rest < W elements of a block: the same vector code on a
  // zero-padded stack copy (padded lanes give m = u = 0: maxima unchanged).
  template <Pass P, DType G, CopyType C>
  static void tail(const Consts& c, const Vec& b, size_t i, size_t rest, BlockState& s, size_t j) {
    constexpr size_t gb = dtype_size(G);
    alignas(64) float p[W] = {};
    alignas(64) unsigned char g[W * 4] = {}, m[W] = {}, v[W] = {}, copy[W * 2] = {};
    std::memcpy(p, b.params_in + i, rest * 4);
    std::memcpy(g, static_cast<const char*>(b.grads) + i * gb, rest * gb);
    std::memcpy(m, b.m_codes_in + i, rest);
    std::memcpy(v, b.v_codes_in + i, rest);
    const VI m_max = s.m_max, u_max = s.u_max;
    do_vec<P, G, C>(c, Vec{p, g, m, v, copy, false, p, m, v}, 0, s, j);
    if constexpr (P == Pass::kUpdate) {  // maxima over the real elements only (a padded lane may be NaN)
      uint32_t m_rest = 0, u_rest = 0;
      for (size_t k = 0; k < rest; ++k) {
        m_rest = std::max(m_rest, abs_bits(s.m_buf[j + k]));
        u_rest = std::max(u_rest, abs_bits(s.u_buf[j + k]));
      }
      s.m_max = I::max_u32(m_max, I::set1i(m_rest));
      s.u_max = I::max_u32(u_max, I::set1i(u_rest));
    }
    std::memcpy(b.params + i, p, rest * 4);
    if (P != Pass::kUpdate) {  // the update writes codes in encode_block
      std::memcpy(b.m_codes + i, m, rest);
      std::memcpy(b.v_codes + i, v, rest);
    }
    if (C != CopyType::kNone) std::memcpy(static_cast<char*>(b.param_copy) + i * 2, copy, rest * 2);
  }

  // One vector's share of the next block's prefetch (Note [Prefetch while
  // encoding]): its params and grads, and the codes once per 64 elements.
  template <DType G>
  static inline void prefetch_next(const Vec& b, size_t at, size_t next_end) {
    if (at >= next_end) return;
    K::prefetch(b.params_in, at * 4);
    K::prefetch(b.grads, at * dtype_size(G));
    if (at % 64 == 0) {
      K::prefetch(b.m_codes_in, at);
      K::prefetch(b.v_codes_in, at);
    }
  }

  // Note [Prefetch while encoding]: encoding touches no memory stream, so the
  // next block's params, grads and codes are prefetched meanwhile (the
  // hardware prefetchers alone run only a few lines ahead of the update).
  template <DType G>
  static void encode_block(const Vec& b, size_t begin, size_t n, size_t count, const float* m_buf,
                           const float* u_buf, V m_inv, V u_inv) {
    const size_t next = begin + n, next_end = std::min(count, next + n);
    const auto m_at = [&](size_t j) { return m_codes(I::mul(I::load_f32(m_buf + j), m_inv)); };
    const auto u_at = [&](size_t j) { return u_codes(I::mul(I::load_f32(u_buf + j), u_inv)); };
    size_t j = 0;
    // Four vectors' codes packed into one store per moment (I::store_u8x4).
    for (; j + 4 * W <= n; j += 4 * W) {
      for (size_t k = 0; k < 4 * W; k += W) prefetch_next<G>(b, next + j + k, next_end);
      I::store_u8x4(b.m_codes + begin + j, m_at(j), m_at(j + W), m_at(j + 2 * W), m_at(j + 3 * W));
      I::store_u8x4(b.v_codes + begin + j, u_at(j), u_at(j + W), u_at(j + 2 * W), u_at(j + 3 * W));
    }
    for (; j + W <= n; j += W) {
      prefetch_next<G>(b, next + j, next_end);
      I::store_u8(b.m_codes + begin + j, m_at(j));
      I::store_u8(b.v_codes + begin + j, u_at(j));
    }
    if (j == n) return;
    alignas(64) uint8_t m[W], v[W];  // the buffer holds W valid floats past j (n < B, B % W == 0)
    I::store_u8(m, m_at(j));
    I::store_u8(v, u_at(j));
    std::memcpy(b.m_codes + begin + j, m, n - j);
    std::memcpy(b.v_codes + begin + j, v, n - j);
  }

  // Runtime (pass, grad dtype, copy) -> one instantiation, once per tile.
  template <Pass P, DType G>
  static void by_copy(const StepFactors& f, const TileSpans& t) {
    switch (t.copy_type) {
      case CopyType::kNone: return run<P, G, CopyType::kNone>(f, t);
      case CopyType::kBF16: return run<P, G, CopyType::kBF16>(f, t);
      case CopyType::kF16: return run<P, G, CopyType::kF16>(f, t);
    }
  }
};

}  // namespace strata::cpu_adam::detail
