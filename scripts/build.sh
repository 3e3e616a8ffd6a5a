#!/usr/bin/env bash
# Configures and builds Strata into build/ (or $STRATA_BUILD_DIR).
# Extra arguments go to cmake's configure step, e.g. -DSTRATA_SANITIZE=ON.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${STRATA_BUILD_DIR:-build}"
jobs="${STRATA_JOBS:-$(nproc)}"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="${STRATA_BUILD_TYPE:-RelWithDebInfo}" "$@"
cmake --build "$build_dir" -j "$jobs"
