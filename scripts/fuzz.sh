#!/usr/bin/env bash
# Runs one libFuzzer target of tests/fuzz for a bounded time.
#   scripts/fuzz.sh TARGET [SECONDS] [extra libFuzzer flags...]
#   scripts/fuzz.sh --list
# Builds with clang (ASan + UBSan + libFuzzer) into build-fuzz/ (or
# $STRATA_FUZZ_BUILD_DIR), seeds from tests/fuzz/corpus/TARGET, grows a working
# corpus in build-fuzz/corpus/TARGET, and copies every crash, leak or broken
# property into tests/fuzz/reproducers/TARGET/, which the normal test suite
# replays (ctest -L fuzz). Exit status: 0 when nothing was found.
# Runs of different targets may go in parallel once each target is built
# (STRATA_FUZZ_NO_BUILD=1 skips the build step).
set -euo pipefail
cd "$(dirname "$0")/.."
targets=$(sed -n 's/^set(STRATA_FUZZ_TARGETS \(.*\))$/\1/p' tests/fuzz/CMakeLists.txt)
if [[ "${1:-}" == "--list" || $# -lt 1 ]]; then
  echo "fuzz targets: $targets"
  [[ $# -ge 1 ]] && exit 0 || { echo "usage: scripts/fuzz.sh TARGET [SECONDS]" >&2; exit 2; }
fi
target="$1"; seconds="${2:-60}"; shift $(( $# >= 2 ? 2 : 1 ))
if ! [[ " $targets " == *" $target "* ]]; then
  echo "fuzz.sh: unknown target '$target'; targets: $targets" >&2; exit 2
fi
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || (( seconds < 1 || seconds > 86400 )); then
  echo "fuzz.sh: SECONDS '$seconds' must be a whole number in 1..86400" >&2; exit 2
fi
if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ not found; install it with: apt-get install clang" >&2; exit 2
fi
build_dir="${STRATA_FUZZ_BUILD_DIR:-build-fuzz}"
jobs="${STRATA_JOBS:-$(nproc)}"
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_CXX_FLAGS="-fno-omit-frame-pointer" \
    -DSTRATA_FUZZ=ON -DSTRATA_ENABLE_CUDA=OFF -DSTRATA_BUILD_BENCH=OFF >/dev/null
else
  cmake "$build_dir" >/dev/null  # picks up targets added since the first configure
fi
if [[ "${STRATA_FUZZ_NO_BUILD:-0}" != "1" ]]; then
  cmake --build "$build_dir" -j "$jobs" --target "strata_fuzz_$target"
fi
work="$build_dir/corpus/$target"
repro="tests/fuzz/reproducers/$target"
mkdir -p "$work" "$repro" "$build_dir/artifacts/$target"
dict=()
[[ -f "tests/fuzz/dict/$target.dict" ]] && dict=(-dict="tests/fuzz/dict/$target.dict")
set +e
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  "$build_dir/tests/fuzz/strata_fuzz_$target" "$work" "tests/fuzz/corpus/$target" \
  -max_total_time="$seconds" -seed="${STRATA_FUZZ_SEED:-1}" -max_len=65536 -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$build_dir/artifacts/$target/" "${dict[@]}" "$@"
rc=$?
set -e
found=0
for f in "$build_dir/artifacts/$target"/*; do
  [[ -f "$f" ]] || continue
  cp "$f" "$repro/"; found=$((found + 1))
  echo "fuzz.sh: saved reproducer $repro/$(basename "$f")"
done
if (( rc != 0 || found > 0 )); then
  echo "fuzz.sh: $target FAILED (exit $rc, $found reproducer(s) in $repro; replay with ctest -R fuzz.replay_$target)" >&2
  exit 1
fi
echo "fuzz.sh: $target ran ${seconds}s, nothing found"
