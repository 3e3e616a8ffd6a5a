#!/usr/bin/env bash
# Configures and builds Strata into build/ (or $STRATA_BUILD_DIR).
# Extra arguments go to cmake's configure step, e.g. -DSTRATA_SANITIZE=ON.
# STRATA_BUILD_TARGETS (space-separated, default: all) builds only those
# targets, e.g. strata_cli for the CLI alone (scripts/quickstart.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${STRATA_BUILD_DIR:-build}"
jobs="${STRATA_JOBS:-$(nproc)}"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="${STRATA_BUILD_TYPE:-RelWithDebInfo}" "$@"
targets=()
for target in ${STRATA_BUILD_TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build_dir" -j "$jobs" "${targets[@]}"
