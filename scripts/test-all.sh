#!/usr/bin/env bash
# Installs dependencies, builds Strata, and runs every test:
#   1. the full suite (ctest) on the release build,
#   2. the core, config and layer unit tests again under ASan+UBSan.
# GPU tests skip cleanly on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs="${STRATA_JOBS:-$(nproc)}"

STRATA_BUILD_DIR=build scripts/build.sh
ctest --test-dir build -j "$jobs" --output-on-failure

if [[ "${STRATA_SKIP_SANITIZE:-0}" != "1" ]]; then
  # The sanitizer build skips CUDA and benchmarks to keep CI quick.
  STRATA_BUILD_DIR=build-asan STRATA_BUILD_TYPE=Debug scripts/build.sh \
    -DSTRATA_SANITIZE=ON -DSTRATA_ENABLE_CUDA=OFF -DSTRATA_BUILD_BENCH=OFF
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan -j "$jobs" --output-on-failure -L "core|config|nvme|cpu_adam"
fi
