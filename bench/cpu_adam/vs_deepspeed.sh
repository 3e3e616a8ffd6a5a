#!/usr/bin/env bash
# Strata's CPU AdamW against DeepSpeed's cpu_adam core, side by side, in one
# process (bench/cpu_adam/vs_deepspeed_driver.cpp, interleaved ABBA pairs).
#
#   bench/cpu_adam/vs_deepspeed.sh DEEPSPEED_CHECKOUT STRATA_BUILD_DIR [WORKDIR] -- DRIVER_ARGS...
#   e.g. git clone https://github.com/deepspeedai/DeepSpeed /tmp/ds && git -C /tmp/ds checkout edaa722
#        bench/cpu_adam/vs_deepspeed.sh /tmp/ds build /tmp/ds-adam -- --mix fp32 --threads 1 --pairs 16
#
# DeepSpeed's sources are Apache-2.0 but not ours: everything built from them
# goes to WORKDIR (default: a fresh mktemp -d), never into this repository.
# WORKDIR gets:
#   - csrc/includes/{cpu_adam.h,simd.h} copied as they are;
#   - ds_steps.inc: the definitions of Adam_Optimizer::Step_1/Step_4/Step_8
#     cut verbatim out of csrc/adam/cpu_adam_impl.cpp (found by their
#     signatures, so other commits work too);
#   - stub/torch/extension.h: c10::BFloat16 / c10::Half / torch::Tensor
#     stand-ins, so no libtorch is needed (the AVX path reinterprets the
#     16-bit pointers; only the scalar tail converts through float);
#   - ds_kernel.cpp: C wrappers doing exactly what ds_adam_step does per call
#     (IncrementStep, update_state, Step_8 with parallel=true);
# and compiles ds_kernel.cpp with the flags DeepSpeed's CPUAdamBuilder uses
# on an x86 host (op_builder/builder.py TorchCPUOpBuilder.cxx_args):
#   -O3 -std=c++17 -g -Wno-reorder -march=native -fopenmp -D__AVX512__ (or -D__AVX256__)
# Then the driver is compiled against Strata's shared libraries and run with
# OMP_WAIT_POLICY=passive.
set -euo pipefail
ds="${1:?usage: vs_deepspeed.sh DEEPSPEED_CHECKOUT STRATA_BUILD_DIR [WORKDIR] -- DRIVER_ARGS...}"
build="${2:?usage: vs_deepspeed.sh DEEPSPEED_CHECKOUT STRATA_BUILD_DIR [WORKDIR] -- DRIVER_ARGS...}"
shift 2
work=""
if [[ $# -gt 0 && "$1" != "--" ]]; then work="$1"; shift; fi
[[ $# -gt 0 && "$1" == "--" ]] && shift
[[ -n "$work" ]] || work="$(mktemp -d /tmp/strata-vs-deepspeed.XXXXXX)"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "$build" && pwd)"
impl="$ds/csrc/adam/cpu_adam_impl.cpp"
for f in "$impl" "$ds/csrc/includes/cpu_adam.h" "$ds/csrc/includes/simd.h"; do
  [[ -f "$f" ]] || { echo "vs_deepspeed.sh: $f not found; is $ds a DeepSpeed checkout?" >&2; exit 2; }
done
for lib in "$build/cpu_adam/libstrata_cpu_adam.so" "$build/core/libstrata_core.so"; do
  [[ -f "$lib" ]] || { echo "vs_deepspeed.sh: $lib not found; build strata_cpu_adam in $build first" >&2; exit 2; }
done
mkdir -p "$work/stub/torch"
cp "$ds/csrc/includes/cpu_adam.h" "$ds/csrc/includes/simd.h" "$work/"
# Step_1, Step_4, Step_8: from their signature line to the closing brace at column 0.
awk '
  /^void Adam_Optimizer::Step_(1|4|8)\(/ { keep = 1; print prev }
  keep { print }
  keep && /^}/ { keep = 0; print "" }
  { prev = $0 }
' "$impl" >"$work/ds_steps.inc"
[[ $(grep -c '^void Adam_Optimizer::Step_' "$work/ds_steps.inc") -eq 3 ]] ||
  { echo "vs_deepspeed.sh: could not find Step_1/4/8 in $impl" >&2; exit 2; }
cat >"$work/stub/torch/extension.h" <<'EOF'
// Stand-in for <torch/extension.h>: just the types cpu_adam.h and the
// Step_1/4/8 templates name.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>
namespace c10 {
struct BFloat16 {
  uint16_t x = 0;
  BFloat16() = default;
  BFloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
struct Half {  // declared by the templates, not run by the driver
  uint16_t x = 0;
  Half() = default;
  Half(float) {}
  operator float() const { return 0.0f; }
};
}  // namespace c10
namespace torch { struct Tensor {}; }
EOF
cat >"$work/ds_kernel.cpp" <<'EOF'
#include <omp.h>
#include "cpu_adam.h"
#include "ds_steps.inc"
extern "C" void* ds_create(float lr, float b1, float b2, float eps, float wd, bool adamw) {
  return new Adam_Optimizer(lr, b1, b2, eps, wd, adamw);
}
extern "C" void ds_set_threads(int t) { omp_set_num_threads(t); }
// What ds_adam_step does per call, without torch's tensor plumbing.
extern "C" void ds_step_f32(void* o, size_t step, float lr, float b1, float b2, float eps, float wd,
                            float* p, float* g, float* m, float* v, size_t n) {
  auto* opt = static_cast<Adam_Optimizer*>(o);
  opt->IncrementStep(step, b1, b2);
  opt->update_state(lr, eps, wd, true);
  opt->Step_8<float, float>(p, g, m, v, n, true);
}
extern "C" void ds_step_bf16(void* o, size_t step, float lr, float b1, float b2, float eps, float wd,
                             uint16_t* p, uint16_t* g, float* m, float* v, size_t n) {
  auto* opt = static_cast<Adam_Optimizer*>(o);
  opt->IncrementStep(step, b1, b2);
  opt->update_state(lr, eps, wd, true);
  opt->Step_8<c10::BFloat16, float>(reinterpret_cast<c10::BFloat16*>(p), reinterpret_cast<c10::BFloat16*>(g), m, v,
                                    n, true);
}
EOF
simd="-D__AVX256__"
grep -q avx512f /proc/cpuinfo && simd="-D__AVX512__"
ds_flags=(-O3 -std=c++17 -g -Wno-reorder -march=native -fopenmp "$simd" -D__DISABLE_CUDA__)
echo "DeepSpeed $(git -C "$ds" rev-parse HEAD 2>/dev/null || echo '(not a git checkout)'), flags: ${ds_flags[*]}"
g++ "${ds_flags[@]}" -I"$work/stub" -I"$work" -c "$work/ds_kernel.cpp" -o "$work/ds_kernel.o"
g++ -O2 -std=c++20 -I"$root/core/include" -I"$root/cpu_adam/include" "$here/vs_deepspeed_driver.cpp" \
  "$work/ds_kernel.o" -o "$work/vs_deepspeed_driver" -fopenmp -L"$build/cpu_adam" -L"$build/core" \
  -lstrata_cpu_adam -lstrata_core -Wl,-rpath,"$build/cpu_adam:$build/core"
echo "built $work/vs_deepspeed_driver; Strata $(git -C "$root" rev-parse --short HEAD)"
[[ $# -eq 0 ]] || OMP_WAIT_POLICY=passive "$work/vs_deepspeed_driver" "$@"
