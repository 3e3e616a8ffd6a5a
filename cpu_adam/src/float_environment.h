#pragma once
// Private: the floating-point environment the optimizer's arithmetic runs in.
//
// Note [Subnormals kept]
// A thread's MXCSR may flush subnormal results to zero (FTZ) or read
// subnormal inputs as zero (DAZ): torch.set_flush_denormal(True) sets both
// on the calling thread, and a thread inherits the bits of the thread that
// made it. The step's results would then depend on which thread ran a tile
// (the caller's or a worker's), and the 8-bit moment codes below 2^-14 of
// their block's maximum, which are computed as fp32 subnormals (Note [Codes
// from fp32's lowest binades], int8_format.h), would all become 0. So every
// tile, probe and span conversion runs with both bits cleared, and the
// caller's bits are restored after it (one MXCSR read per tile, and a write
// only where a bit was set).
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace strata::cpu_adam::detail {

class SubnormalsKept {
 public:
  SubnormalsKept() {
#if defined(__SSE__) || defined(__x86_64__)
    constexpr unsigned kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;
    saved_ = _mm_getcsr();
    changed_ = (saved_ & (kFlushToZero | kDenormalsAreZero)) != 0;
    if (changed_) _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero));
#endif  // elsewhere IEEE subnormals are the default and there are no such bits
  }
  ~SubnormalsKept() {
#if defined(__SSE__) || defined(__x86_64__)
    if (changed_) _mm_setcsr(saved_);
#endif
  }
  SubnormalsKept(const SubnormalsKept&) = delete;
  SubnormalsKept& operator=(const SubnormalsKept&) = delete;

 private:
  unsigned saved_ = 0;
  bool changed_ = false;
};

}  // namespace strata::cpu_adam::detail
