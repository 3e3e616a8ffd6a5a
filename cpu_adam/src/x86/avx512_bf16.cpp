// AVX-512 path using AVX512-BF16's vcvtneps2bf16 for bf16 stores (Cooper
// Lake, Sapphire Rapids and later, Zen 4). Compiled with -mavx512bf16.
#define STRATA_CPU_ADAM_AVX512_BF16_INSN 1
#include "avx512_traits.h"

namespace strata::cpu_adam::detail {
const KernelTable& avx512_bf16_kernels() { return Kernels<Avx512<true>>::table(); }
}  // namespace strata::cpu_adam::detail
