#!/usr/bin/env bash
# Installs the Debian packages Strata builds and tests with. Idempotent:
# packages already present are skipped, apt-get update runs only when needed.
# Usage: scripts/install-deps.sh [--with-torch]   (python3-torch: PyTorch comparisons)
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache git
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libcli11-dev nlohmann-json3-dev libxxhash-dev
  libtbb-dev libopenblas-dev
  liburing-dev libaio-dev
  libopenmpi-dev openmpi-bin
  fio python3
  xz-utils   # scripts/gpu-pack.sh (tar -J) and its test
  python3-matplotlib   # strata bench offload --plot (scripts/plot_offload.py; its test skips without it)
  clang libclang-rt-14-dev   # libFuzzer targets (scripts/fuzz.sh, tests/fuzz)
  pybind11-dev python3-venv python3-pytest   # the strata Python package (python/test.sh)
)
with_torch=0
for arg in "$@"; do
  case "$arg" in
    --with-torch) with_torch=1 ;;
    *) echo "install-deps: unknown argument '$arg' (usage: scripts/install-deps.sh [--with-torch])" >&2
       exit 2 ;;
  esac
done
if ((with_torch)); then
  # Debian's torch and numpy install under /usr/bin/python3, which the tests
  # pick over a python3 earlier on PATH that cannot import them (pyenv, venv).
  packages+=(python3-torch python3-numpy)
fi

check_torch() {
  if ((with_torch)) && ! /usr/bin/python3 -c "import numpy, torch" 2>/dev/null; then
    echo "install-deps: python3-torch is installed but /usr/bin/python3 cannot import torch and numpy" >&2
    exit 1
  fi
}

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages already installed"
  check_torch
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  if ! command -v sudo > /dev/null; then
    echo "install-deps: missing ${missing[*]}; run this as root or install sudo" >&2
    exit 1
  fi
  SUDO="sudo"
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
check_torch
