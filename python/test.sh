#!/usr/bin/env bash
# Builds the strata Python package (the native module, -DSTRATA_BUILD_PYTHON=ON)
# and runs its pytest suite in a virtual environment of /usr/bin/python3 (the
# native module is built for that interpreter). Two torch environments:
#   debian (default)  a venv with --system-site-packages: Debian's python3-torch
#                     (1.13), numpy and pytest, plus transformers 4.40.2 and
#                     accelerate 0.30.1 from PyPI (the last releases for torch 1.13);
#   torch2            STRATA_PYTHON_ENV=torch2: a venv of its own (Debian's torch
#                     must not leak in) with torch 2.15.0, transformers 5.24.0,
#                     accelerate 1.15.0, numpy and pytest from PyPI (about 2 minutes and 5.6 GB the
#                     first time; reused after).
# The package is put on the venv's path with a .pth file pointing at the staged
# build/python folder. A missing torch, transformers or mpirun is an error, not
# a skip.
#   python/test.sh [pytest args...]
# Environment: STRATA_PYTHON_BUILD_DIR (default build-py), STRATA_JOBS, STRATA_PYTHON_ENV.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${STRATA_PYTHON_BUILD_DIR:-build-py}"
jobs="${STRATA_JOBS:-$(nproc)}"
python=/usr/bin/python3
environment="${STRATA_PYTHON_ENV:-debian}"
case "$environment" in
  debian) venv_name=venv ;;
  torch2) venv_name=venv-torch2 ;;
  *) echo "python/test.sh: STRATA_PYTHON_ENV='$environment' is not debian or torch2" >&2; exit 2 ;;
esac

if [[ "$environment" == debian ]] && ! "$python" -c "import torch, numpy, pytest" 2>/dev/null; then
  echo "python/test.sh: $python cannot import torch, numpy and pytest;" \
       "run scripts/install-deps.sh --with-torch (python3-torch, python3-numpy, python3-pytest)" >&2
  exit 1
fi

mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE="${STRATA_BUILD_TYPE:-RelWithDebInfo}" \
  -DSTRATA_BUILD_PYTHON=ON -DPython_EXECUTABLE="$python" > "$build_dir/python-configure.log" 2>&1 ||
  { cat "$build_dir/python-configure.log" >&2; exit 1; }
cmake --build "$build_dir" -j "$jobs" --target strata_native

venv="$(cd "$build_dir" && pwd)/python/$venv_name"
if [[ "$environment" == debian ]]; then
  [[ -x "$venv/bin/python" ]] || "$python" -m venv --system-site-packages "$venv"
  wanted=(transformers==4.40.2 accelerate==0.30.1)
  check='import transformers, accelerate, safetensors
assert transformers.__version__ == "4.40.2" and accelerate.__version__ == "0.30.1"'
else
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  wanted=(torch==2.15.0 transformers==5.24.0 accelerate==1.15.0 numpy pytest)
  check='import torch, transformers, accelerate, numpy, pytest, safetensors
assert torch.__version__.split("+")[0] == "2.15.0" and transformers.__version__ == "5.24.0"
assert accelerate.__version__ == "1.15.0"'
fi
if ! "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "python/test.sh: installing ${wanted[*]} into $venv (PyPI)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${wanted[@]}"
  "$venv/bin/python" -c "$check"
fi
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$(cd "$build_dir/python" && pwd)" > "$site/strata-build.pth"
"$venv/bin/python" -c "import torch, transformers; print(f'python/test.sh: torch {torch.__version__}, transformers {transformers.__version__}')"

cd python/tests
export STRATA_REQUIRE_TORCH=1 STRATA_REQUIRE_TRANSFORMERS=1 STRATA_REQUIRE_MPI=1
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
