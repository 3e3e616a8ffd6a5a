#!/usr/bin/env bash
# Builds strata.torch's native module for another Python (issue 50 §2): the GPU
# machine runs Python 3.12 with torch 2.11, this machine's build is for Debian's
# Python 3.11. Configures BUILD_DIR (default build-py312) with CUDA and only the
# libraries the module links (no tests, no benchmarks), builds the module and
# prints its path; scripts/gpu-pack.sh packs it with
# STRATA_GPU_PACK_PYTHON_MODULE=<that path>.
#
#   scripts/gpu-torch-module.sh [PYTHON] [BUILD_DIR]
#     PYTHON     an interpreter with its headers (default: pyenv's 3.12, python3.12 on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${2:-build-py312}"
runs() { "$1" -c 'import sys' > /dev/null 2>&1; }
if [[ -n "${1:-}" ]]; then
  python=$1
  if ! runs "$python"; then
    echo "gpu-torch-module: the Python interpreter '$python' does not run here; give one with its headers as the first argument" >&2
    exit 1
  fi
else
  # pyenv's python3.12 shim fails unless 3.12 is among pyenv's selected versions: try the installed one too.
  python=""
  for candidate in python3.12 "$(pyenv root 2> /dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
    if runs "$candidate"; then python=$candidate; break; fi
  done
  if [[ -z "$python" ]]; then
    echo "gpu-torch-module: no Python 3.12 runs here (python3.12 on PATH, pyenv's versions/3.12*); give one with its headers as the first argument" >&2
    exit 1
  fi
fi
python=$("$python" -c 'import sys; print(sys.executable)')  # pyenv's shim -> the interpreter itself
include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if [[ ! -f "$include/Python.h" ]]; then
  echo "gpu-torch-module: $python has no headers ($include/Python.h is missing); install its development files" >&2
  exit 1
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE="${STRATA_BUILD_TYPE:-RelWithDebInfo}" -DSTRATA_ENABLE_CUDA=ON \
  -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF -DSTRATA_BUILD_PYTHON=ON -DPython_EXECUTABLE="$python" > /dev/null
grep -q '^STRATA_HAVE_CUDA:INTERNAL=1\|^STRATA_ENABLE_CUDA:BOOL=ON' "$build/CMakeCache.txt" ||
  { echo "gpu-torch-module: $build was not configured with CUDA" >&2; exit 1; }
cmake --build "$build" -j "${STRATA_JOBS:-$(nproc)}" --target strata_native > /dev/null
module=$(ls "$build"/python/strata/_native*.so | head -1)
echo "$module"
