#!/usr/bin/env bash
# Installs the peer's wheel set (scripts/gpu-peer-wheels.sh) with no index
# into a new venv over a Python that has torch: what gpu-check.sh runs on the
# GPU machine, and what `gpu-peer-wheels.sh --check` runs here over a
# stand-in for that machine.
#
#   scripts/gpu-peer-venv.sh MACHINE_PYTHON WHEELS_DIR VENV
#
# The machine's python3 is itself a venv (/opt/torch/.venv), and a venv made
# from it with --system-site-packages sees the base interpreter's packages,
# not its torch. So the new venv gets a .pth file naming MACHINE_PYTHON's
# site-packages folders (its own folder stays first, so a carried wheel wins
# over the machine's copy), and is made without pip (the base may lack
# ensurepip): MACHINE_PYTHON's pip installs into it with --python, seeing
# the machine's packages as installed, so only what is missing comes from
# WHEELS_DIR.
set -euo pipefail
if [[ $# -ne 3 ]]; then
  echo "usage: gpu-peer-venv.sh MACHINE_PYTHON WHEELS_DIR VENV" >&2
  exit 2
fi
machine_python="$1" wheels="$2" venv="$3"
"$machine_python" -c 'import sys' 2> /dev/null || { echo "gpu-peer-venv.sh: MACHINE_PYTHON '$machine_python' does not run" >&2; exit 2; }
deepspeed_wheel=$(compgen -G "$wheels/deepspeed-*.whl" | head -1 || true)
if [[ -z "$deepspeed_wheel" ]]; then
  echo "gpu-peer-venv.sh: no deepspeed wheel in WHEELS_DIR '$wheels' (make it with scripts/gpu-peer-wheels.sh)" >&2
  exit 2
fi
deepspeed_version=$(basename "$deepspeed_wheel" | cut -d- -f2)
"$machine_python" -m venv --without-pip "$venv"
venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$machine_python" -c 'import sys
print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' > "$venv_site/gpu-machine.pth"
"$machine_python" -m pip --python "$venv/bin/python" install -q --no-index --no-compile \
  --find-links "$wheels" "deepspeed==$deepspeed_version"
echo "gpu-peer-venv.sh: deepspeed $deepspeed_version installed into $venv over $machine_python's packages"
