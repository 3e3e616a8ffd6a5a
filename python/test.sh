#!/usr/bin/env bash
# Builds the strata Python package (the native module, -DSTRATA_BUILD_PYTHON=ON)
# and runs its pytest suite in a virtual environment made from /usr/bin/python3
# with --system-site-packages (Debian's python3-torch, numpy and pytest belong
# to that interpreter). The package is put on the venv's path with a .pth file
# pointing at the staged build/python folder (no network, no pip).
# A missing torch is an error, not a skip.
#   python/test.sh [pytest args...]
# Environment: STRATA_PYTHON_BUILD_DIR (default build-py), STRATA_JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${STRATA_PYTHON_BUILD_DIR:-build-py}"
jobs="${STRATA_JOBS:-$(nproc)}"
python=/usr/bin/python3

if ! "$python" -c "import torch, numpy, pytest" 2>/dev/null; then
  echo "python/test.sh: $python cannot import torch, numpy and pytest;" \
       "run scripts/install-deps.sh --with-torch (python3-torch, python3-numpy, python3-pytest)" >&2
  exit 1
fi

mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="${STRATA_BUILD_TYPE:-RelWithDebInfo}" \
  -DSTRATA_BUILD_PYTHON=ON -DPython_EXECUTABLE="$python" > "$build_dir/python-configure.log" 2>&1 ||
  { cat "$build_dir/python-configure.log" >&2; exit 1; }
cmake --build "$build_dir" -j "$jobs" --target strata_native

venv="$(cd "$build_dir" && pwd)/python/venv"
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv --system-site-packages "$venv"
fi
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$(cd "$build_dir/python" && pwd)" > "$site/strata-build.pth"

cd python/tests
export STRATA_REQUIRE_TORCH=1
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
