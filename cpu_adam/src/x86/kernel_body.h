#pragma once
// The SIMD optimizer kernels, written once over an ISA traits struct I
// (avx2.cpp: 8 lanes, avx512.cpp / avx512_bf16.cpp: 16 lanes) and
// instantiated for every (optimizer family, grad dtype, moment dtype, copy
// type). Included only by the x86 source files, each compiled with its own
// -m flags (and by tests/cpu_adam/stream_bytes_test.cpp with a counting ISA).
//
// I provides: V, kWidth, load_f32/store_f32, load_bf16/store_bf16,
// load_f16/store_f16, set1, add, sub, mul, div, sqrt, fmadd, sign,
// sum_squares helpers (zero_d, accumulate_squares, reduce_d), and for the
// streaming probe the raw types R32/R16 with load_raw32/store_raw32,
// load_raw16/store_raw16, keep (an optimization barrier) and low16; for
// the copy bf16_bits/f16_bits (rounded bits), stream_raw16 (non-temporal
// store, aligned) and store_fence.
//
// The update performs the float operations of Note [Update formulas]
// (reference.cpp) in the same order, each FMA fused exactly where the
// reference calls std::fma and nowhere else (-ffp-contract=off), so results
// are bit-identical to the scalar reference. Tails (count % kWidth) run the
// same vector code on a zero-padded copy on the stack, so there is no
// second, scalar code path to keep in sync.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../kernels.h"

namespace strata::cpu_adam::detail {

enum class Family : uint8_t { kAdam, kAdagrad, kLion };

// Note [Software prefetch]
// Whether prefetching helps depends on the CPU's hardware prefetchers, so
// the default follows the measurements (docs/performance.md):
// - Intel (the 2-core Xeon VM of issue 4): with the hardware prefetchers
//   alone one core left bandwidth unused; prefetching every input stream
//   1024 elements ahead (4 KiB of fp32) took the step from 0.80-0.87 to
//   0.93-0.99 of the probe. Default 1024.
// - AMD (the 2-core EPYC VM of issue 9): the same prefetch made the step
//   ~10% slower (fp32 AdamW vs DeepSpeed, interleaved: 0.88-0.95 with it,
//   1.00-1.14 without; 256 was neutral, 4096 worse). Default 0 (off).
// The probes run as a plain loop, or with the same prefetch when asked (the
// bench takes the faster of the two as the ceiling).
// STRATA_CPU_ADAM_PREFETCH=<elements> overrides the distance (0 = off).
inline size_t prefetch_elements() {
  static const size_t v = [] {
    const char* e = std::getenv("STRATA_CPU_ADAM_PREFETCH");
    if (e != nullptr && *e != '\0') return static_cast<size_t>(std::strtoul(e, nullptr, 10));
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? size_t{0} : size_t{1024};
  }();
  return v;
}

// Note [Streaming probe]
// The physical limit of the step's access pattern: a loop that loads every
// byte the step loads and stores every byte it stores, in the same element
// order, tiles, threads and vector width, with no arithmetic at all: each stream
// is loaded raw (no dtype conversion) and stored back unchanged; an
// empty asm barrier (I::keep) stops the compiler from dropping the
// load/store pairs; the 16-bit copy receives the low 16 bits of each
// param's bit pattern (one narrowing shuffle). So params, grads and moments
// are left bit-identical and only the copy is overwritten.
// tests/cpu_adam/stream_bytes_test.cpp counts the bytes both move.
//
// Note [Non-temporal copy]
// The bf16/fp16 param copy is the one stream the step only writes. A normal
// store first reads each line for ownership, so it costs 4 bytes of memory
// traffic per element for 2 bytes of data; a non-temporal store writes the
// line without reading it (28 instead of 30 bytes per element for the bf16
// mix). Its reader is a DMA engine (H2D copy) or an NVMe write, not this
// core's cache. Used when the copy's vectors are aligned (checked per tile),
// with an sfence at the end of the tile so the tile callback and other
// threads see the data; StepFactors::copy_non_temporal = false
// (STRATA_CPU_ADAM_NT_COPY=0, read in optimizer.cpp) turns it off. The
// streaming probe stores the copy the same way, so it keeps measuring the
// step's exact access pattern.
//
// Note [Out-of-place steps] (docs/cpu_adam.md): an update that reads the
// state from sources (TileSpans::*_in) and writes it elsewhere has three
// more write-only streams, the params and moments it writes: with normal
// stores each would be read for ownership first (40 instead of 28 bytes per
// element for fp32 AdamW with a bf16 copy; measured 1.8x the in-place step's
// time on one core of the VM). They are stored non-temporally like the
// copy, when their vectors are aligned (checked per tile) and the copy's
// switch (copy_non_temporal) is on; then it moves the in-place step's bytes.
template <class I>
struct Int8Kernels;  // kernel_body_int8.h: Adam/AdamW with 8-bit moments

template <class I>
struct Kernels {
  using V = typename I::V;
  static constexpr size_t W = I::kWidth;

  template <DType T>
  static V load(const void* base, size_t i) {
    if constexpr (T == DType::kF32) return I::load_f32(static_cast<const float*>(base) + i);
    else if constexpr (T == DType::kBF16) return I::load_bf16(static_cast<const uint16_t*>(base) + i);
    else return I::load_f16(static_cast<const uint16_t*>(base) + i);
  }
  template <DType T>
  static void store(void* base, size_t i, V x) {
    if constexpr (T == DType::kF32) I::store_f32(static_cast<float*>(base) + i, x);
    else if constexpr (T == DType::kBF16) I::store_bf16(static_cast<uint16_t*>(base) + i, x);
    else I::store_f16(static_cast<uint16_t*>(base) + i, x);
  }
  // The copy is a write-only stream: Note [Non-temporal copy].
  static void store_copy_bits(void* base, size_t i, typename I::R16 bits, bool non_temporal) {
    if (non_temporal) I::stream_raw16(static_cast<uint16_t*>(base) + i, bits);
    else I::store_raw16(static_cast<uint16_t*>(base) + i, bits);
  }
  template <CopyType C>
  static void store_copy(void* base, size_t i, V p, bool non_temporal) {
    if constexpr (C == CopyType::kBF16) store_copy_bits(base, i, I::bf16_bits(p), non_temporal);
    else if constexpr (C == CopyType::kF16) store_copy_bits(base, i, I::f16_bits(p), non_temporal);
  }

  // The step's factors, broadcast once per tile.
  struct Consts {
    explicit Consts(const StepFactors& f)
        : grad_multiplier(I::set1(f.grad_multiplier)), neg_lr(I::set1(f.neg_lr)),
          one_minus_beta1(I::set1(f.one_minus_beta1)), beta2(I::set1(f.beta2)),
          one_minus_beta2(I::set1(f.one_minus_beta2)), eps(I::set1(f.eps)),
          weight_decay(I::set1(f.weight_decay)), decay_factor(I::set1(f.decay_factor)),
          neg_step_size(I::set1(f.neg_step_size)), inv_bias_correction2_sqrt(I::set1(f.inv_bias_correction2_sqrt)),
          l2_decay(f.l2_decay), decoupled_decay(f.decoupled_decay) {}
    V grad_multiplier, neg_lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor,
        neg_step_size, inv_bias_correction2_sqrt;
    bool l2_decay, decoupled_decay;
  };

  // Pointers for one block of W elements at index i. The update reads the
  // state from the *_in pointers (the outputs themselves in place, or an
  // out-of-place step's sources) and writes the outputs; the probes run in
  // place.
  struct Block {
    float* params;
    const void* grads;
    void* exp_avg;
    void* exp_avg_sq;
    void* param_copy;
    bool copy_non_temporal;  // Note [Non-temporal copy]
    const float* params_in;
    const void* exp_avg_in;
    const void* exp_avg_sq_in;
    bool out_non_temporal = false;  // Note [Out-of-place steps]
  };
  // A written state stream: non-temporal out of place (aligned, Note [Out-of-place steps]).
  template <DType T>
  static void store_state(void* base, size_t i, V x, bool non_temporal) {
    if (!non_temporal) return store<T>(base, i, x);
    if constexpr (T == DType::kF32) I::stream_f32(static_cast<float*>(base) + i, x);
    else if constexpr (T == DType::kBF16) I::stream_raw16(static_cast<uint16_t*>(base) + i, I::bf16_bits(x));
    else I::stream_raw16(static_cast<uint16_t*>(base) + i, I::f16_bits(x));
  }

  // Note [Update formulas] (reference.cpp), operation for operation.
  template <Family F, DType G, DType M, CopyType C>
  static inline void update_block(const Consts& c, const Block& b, size_t i) {
    V p = I::load_f32(b.params_in + i);
    V g = I::mul(load<G>(b.grads, i), c.grad_multiplier);
    if constexpr (F == Family::kAdam) {
      V m = load<M>(b.exp_avg_in, i);
      V v = load<M>(b.exp_avg_sq_in, i);
      if (c.l2_decay) g = I::fmadd(c.weight_decay, p, g);
      m = I::fmadd(c.one_minus_beta1, I::sub(g, m), m);
      v = I::fmadd(I::mul(c.one_minus_beta2, g), g, I::mul(v, c.beta2));
      const V denom = I::fmadd(I::sqrt(v), c.inv_bias_correction2_sqrt, c.eps);
      if (c.decoupled_decay) p = I::mul(p, c.decay_factor);
      p = I::fmadd(c.neg_step_size, I::div(m, denom), p);
      store_state<M>(b.exp_avg, i, m, b.out_non_temporal);
      store_state<M>(b.exp_avg_sq, i, v, b.out_non_temporal);
    } else if constexpr (F == Family::kAdagrad) {
      V s = load<M>(b.exp_avg_sq_in, i);
      if (c.l2_decay) g = I::fmadd(c.weight_decay, p, g);
      s = I::fmadd(g, g, s);
      p = I::fmadd(c.neg_lr, I::div(g, I::add(I::sqrt(s), c.eps)), p);
      store_state<M>(b.exp_avg_sq, i, s, b.out_non_temporal);
    } else {
      V m = load<M>(b.exp_avg_in, i);
      const V interpolated = I::fmadd(c.one_minus_beta1, I::sub(g, m), m);
      if (c.decoupled_decay) p = I::mul(p, c.decay_factor);
      p = I::fmadd(c.neg_lr, I::sign(interpolated), p);
      m = I::fmadd(c.one_minus_beta2, I::sub(g, m), m);
      store_state<M>(b.exp_avg, i, m, b.out_non_temporal);
    }
    store_state<DType::kF32>(b.params, i, p, b.out_non_temporal);
    store_copy<C>(b.param_copy, i, p, b.copy_non_temporal);
  }

  // The conversion probe: same loads and stores through the dtype
  // conversions, one add per stream (the ceiling before issue 9; kept as a
  // second figure).
  template <Family F, DType G, DType M, CopyType C>
  static inline void probe_block(const Consts&, const Block& b, size_t i) {
    const bool nt = b.out_non_temporal;
    const V g = load<G>(b.grads, i);
    const V p = I::add(I::load_f32(b.params_in + i), g);
    store_state<DType::kF32>(b.params, i, p, nt);
    if constexpr (F != Family::kAdagrad) store_state<M>(b.exp_avg, i, I::add(load<M>(b.exp_avg_in, i), g), nt);
    if constexpr (F != Family::kLion) store_state<M>(b.exp_avg_sq, i, I::add(load<M>(b.exp_avg_sq_in, i), g), nt);
    store_copy<C>(b.param_copy, i, p, b.copy_non_temporal);
  }

  // The streaming probe, Note [Streaming probe]: raw loads and stores only
  // (from the sources to the outputs: the same buffer in place).
  static inline void put_raw32(void* at, typename I::R32 x, bool non_temporal) {
    if (non_temporal) I::stream_raw32(at, x);
    else I::store_raw32(at, x);
  }
  template <DType T>
  static inline void stream_element(const void* in, void* out, size_t i, bool non_temporal) {
    if constexpr (T == DType::kF32) {
      auto x = I::load_raw32(static_cast<const char*>(in) + i * 4);
      I::keep(x);
      put_raw32(static_cast<char*>(out) + i * 4, x, non_temporal);
    } else {
      auto x = I::load_raw16(static_cast<const char*>(in) + i * 2);
      I::keep(x);
      if (non_temporal) I::stream_raw16(static_cast<char*>(out) + i * 2, x);
      else I::store_raw16(static_cast<char*>(out) + i * 2, x);
    }
  }
  template <Family F, DType G, DType M, CopyType C>
  static inline void stream_block(const Consts&, const Block& b, size_t i) {
    auto p = I::load_raw32(reinterpret_cast<const char*>(b.params_in) + i * 4);
    if constexpr (G == DType::kF32) {
      auto g = I::load_raw32(static_cast<const char*>(b.grads) + i * 4);
      I::keep(g);
    } else {
      auto g = I::load_raw16(static_cast<const char*>(b.grads) + i * 2);
      I::keep(g);
    }
    if constexpr (F != Family::kAdagrad) stream_element<M>(b.exp_avg_in, b.exp_avg, i, b.out_non_temporal);
    if constexpr (F != Family::kLion) stream_element<M>(b.exp_avg_sq_in, b.exp_avg_sq, i, b.out_non_temporal);
    I::keep(p);
    put_raw32(reinterpret_cast<char*>(b.params) + i * 4, p, b.out_non_temporal);
    if constexpr (C != CopyType::kNone) store_copy_bits(b.param_copy, i, I::low16(p), b.copy_non_temporal);
  }

  // What a pass computes: the update, the conversion probe or the streaming probe.
  enum class Pass : uint8_t { kUpdate, kProbe, kStream };

  template <Pass P, Family F, DType G, DType M, CopyType C>
  static inline void do_block(const Consts& c, const Block& b, size_t i) {
    if constexpr (P == Pass::kProbe) probe_block<F, G, M, C>(c, b, i);
    else if constexpr (P == Pass::kStream) stream_block<F, G, M, C>(c, b, i);
    else update_block<F, G, M, C>(c, b, i);
  }

  static inline void prefetch(const void* base, size_t byte_offset) {
    __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) + byte_offset), 0, 3);
  }

  template <Pass P, Family F, DType G, DType M, CopyType C>
  static void run(const StepFactors& f, const TileSpans& t) {
    const Consts c(f);
    // Whole vectors of the copy are aligned iff its first one is (i steps by W).
    const bool non_temporal = C != CopyType::kNone && f.copy_non_temporal &&
                              reinterpret_cast<uintptr_t>(t.param_copy) % (W * 2) == 0;
    constexpr bool has_m = F != Family::kAdagrad, has_v = F != Family::kLion;
    constexpr size_t gb = dtype_size(G), mb = dtype_size(M);
    auto aligned = [](const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
    const bool out_non_temporal = t.params_in != t.params && f.copy_non_temporal &&
                                  aligned(t.params, W * 4) && (!has_m || aligned(t.exp_avg, W * mb)) &&
                                  (!has_v || aligned(t.exp_avg_sq, W * mb));
    const Block b{t.params,     t.grads,     t.exp_avg,    t.exp_avg_sq,    t.param_copy,
                  non_temporal, t.params_in, t.exp_avg_in, t.exp_avg_sq_in, out_non_temporal};
    size_t i = 0;
    const size_t ahead = P != Pass::kUpdate && !f.probe_prefetch ? 0 : prefetch_elements();
    if (ahead == 0) {
      for (; i + W <= t.count; i += W) do_block<P, F, G, M, C>(c, b, i);
    } else {
      for (; i + W <= t.count; i += W) {
        const size_t j = i + ahead;
        prefetch(b.params_in, j * 4);
        prefetch(b.grads, j * dtype_size(G));
        if constexpr (F != Family::kAdagrad) prefetch(b.exp_avg_in, j * dtype_size(M));
        if constexpr (F != Family::kLion) prefetch(b.exp_avg_sq_in, j * dtype_size(M));
        do_block<P, F, G, M, C>(c, b, i);
      }
    }
    // The tile is final for other threads and DMA when run() returns.
    if (non_temporal || out_non_temporal) I::store_fence();
    const size_t rest = t.count - i;
    if (rest == 0) return;
    // Tail: the same vector code on a zero-padded stack copy.
    alignas(64) float p[W] = {};
    alignas(64) unsigned char g[W * 4] = {}, m[W * 4] = {}, v[W * 4] = {}, copy[W * 2] = {};
    std::memcpy(p, t.params_in + i, rest * 4);
    std::memcpy(g, static_cast<const char*>(t.grads) + i * gb, rest * gb);
    if (has_m) std::memcpy(m, static_cast<const char*>(t.exp_avg_in) + i * mb, rest * mb);
    if (has_v) std::memcpy(v, static_cast<const char*>(t.exp_avg_sq_in) + i * mb, rest * mb);
    do_block<P, F, G, M, C>(c, Block{p, g, m, v, copy, false, p, m, v}, 0);
    std::memcpy(t.params + i, p, rest * 4);
    if (has_m) std::memcpy(static_cast<char*>(t.exp_avg) + i * mb, m, rest * mb);
    if (has_v) std::memcpy(static_cast<char*>(t.exp_avg_sq) + i * mb, v, rest * mb);
    if (C != CopyType::kNone) std::memcpy(static_cast<char*>(t.param_copy) + i * 2, copy, rest * 2);
  }

  // Runtime (kind, dtypes, copy) -> one instantiation; once per tile.
  template <Pass P, Family F, DType G, DType M>
  static void by_copy(const StepFactors& f, const TileSpans& t) {
    switch (t.copy_type) {
      case CopyType::kNone: return run<P, F, G, M, CopyType::kNone>(f, t);
      case CopyType::kBF16: return run<P, F, G, M, CopyType::kBF16>(f, t);
      case CopyType::kF16: return run<P, F, G, M, CopyType::kF16>(f, t);
    }
  }
  template <Pass P, Family F, DType G>
  static void by_moment(const StepFactors& f, const TileSpans& t) {
    if constexpr (F == Family::kAdam) {
      if (t.block_elements != 0) return Int8Kernels<I>::template by_copy<P, G>(f, t);
    }
    if (t.moment_dtype == DType::kBF16) return by_copy<P, F, G, DType::kBF16>(f, t);
    return by_copy<P, F, G, DType::kF32>(f, t);
  }
  template <Pass P, Family F>
  static void by_grad(const StepFactors& f, const TileSpans& t) {
    switch (t.grad_dtype) {
      case DType::kF32: return by_moment<P, F, DType::kF32>(f, t);
      case DType::kBF16: return by_moment<P, F, DType::kBF16>(f, t);
      case DType::kF16: return by_moment<P, F, DType::kF16>(f, t);
      case DType::kF64:
      case DType::kI64: break;  // rejected by validate_state
    }
  }
  template <Pass P>
  static void by_kind(const StepFactors& f, const TileSpans& t) {
    switch (f.kind) {
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW: return by_grad<P, Family::kAdam>(f, t);
      case OptimizerKind::kAdagrad: return by_grad<P, Family::kAdagrad>(f, t);
      case OptimizerKind::kLion: return by_grad<P, Family::kLion>(f, t);
    }
  }
  static void update(const StepFactors& f, const TileSpans& t) { by_kind<Pass::kUpdate>(f, t); }
  static void probe(const StepFactors& f, const TileSpans& t) { by_kind<Pass::kProbe>(f, t); }
  static void stream(const StepFactors& f, const TileSpans& t) { by_kind<Pass::kStream>(f, t); }

  // Sum of squares in double: each fp32 square is exact in double, so only
  // the additions round; 4 accumulators hide the add latency.
  template <DType G>
  static double sum_squares_typed(const void* grads, size_t count) {
    typename I::D acc[4] = {I::zero_d(), I::zero_d(), I::zero_d(), I::zero_d()};
    size_t i = 0;
    for (; i + 2 * W <= count; i += 2 * W) {
      I::accumulate_squares(load<G>(grads, i), acc[0], acc[1]);
      I::accumulate_squares(load<G>(grads, i + W), acc[2], acc[3]);
    }
    for (; i + W <= count; i += W) I::accumulate_squares(load<G>(grads, i), acc[0], acc[1]);
    double sum = I::reduce_d(acc[0]) + I::reduce_d(acc[1]) + I::reduce_d(acc[2]) + I::reduce_d(acc[3]);
    for (; i < count; ++i) {
      double g;
      if constexpr (G == DType::kF32) g = static_cast<const float*>(grads)[i];
      else if constexpr (G == DType::kBF16) g = bf16_bits_to_fp32(static_cast<const uint16_t*>(grads)[i]);
      else g = fp16_bits_to_fp32(static_cast<const uint16_t*>(grads)[i]);
      sum += g * g;
    }
    return sum;
  }
  static double sum_squares(const void* grads, DType grad_dtype, size_t count) {
    switch (grad_dtype) {
      case DType::kF32: return sum_squares_typed<DType::kF32>(grads, count);
      case DType::kBF16: return sum_squares_typed<DType::kBF16>(grads, count);
      case DType::kF16: return sum_squares_typed<DType::kF16>(grads, count);
      case DType::kF64:
      case DType::kI64: break;  // rejected by grad_stats
    }
    return 0.0;
  }

  static const KernelTable& table() {
    static const KernelTable t{&update, &probe, &stream, &sum_squares};
    return t;
  }
};

}  // namespace strata::cpu_adam::detail

#include "kernel_body_int8.h"
