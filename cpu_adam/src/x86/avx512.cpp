// AVX-512 F/BW/VL path, 16 lanes, bf16 rounding with integer ops (for
// AVX-512 CPUs without AVX512-BF16, e.g. Skylake-SP, Ice Lake).
#include "avx512_traits.h"

namespace strata::cpu_adam::detail {
const KernelTable& avx512_kernels() { return Kernels<Avx512<false>>::table(); }
}  // namespace strata::cpu_adam::detail
