#!/usr/bin/env bash
# Installs the Debian packages Strata builds and tests with. Idempotent:
# packages already present are skipped, apt-get update runs only when needed.
# Usage: scripts/install-deps.sh [--with-torch]   (python3-torch: PyTorch comparisons)
set -euo pipefail

packages=(
  build-essential cmake pkg-config ccache git
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libcli11-dev nlohmann-json3-dev libxxhash-dev
  libtbb-dev libopenblas-dev
  liburing-dev libaio-dev
  libopenmpi-dev openmpi-bin
  fio python3
)
if [[ "${1:-}" == "--with-torch" ]]; then
  packages+=(python3-torch python3-numpy)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
