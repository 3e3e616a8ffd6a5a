#!/usr/bin/env bash
# Peer benchmark of strata.torch against plain torch and DeepSpeed (issue 23,
# docs/performance.md "strata.torch against plain torch and DeepSpeed").
#
#   scripts/bench-torch-peers.sh [--venv DIR] [--strata-python DIR] [--install-only] [-- bench args]
#
# Creates a venv from /usr/bin/python3 at DIR (default /tmp/strata-peers-venv),
# without the system site-packages so Debian's torch 1.13 stays out, and installs
# the pinned peers into it: torch, transformers, numpy, and DeepSpeed with
# DS_BUILD_OPS=0 (its CPU Adam op is JIT-built by DeepSpeed at first use, with
# the venv's compiler flags and torch headers). pip is skipped when the venv
# already imports the pinned versions. DeepSpeed is never a dependency of the
# project: it lives in this venv only.
#
# Then runs python/bench/bench_torch_peers.py with the venv's python and
# PYTHONPATH set to the staged strata package (--strata-python, default
# build/python; it must hold a native module built for Python 3.11, the
# version of /usr/bin/python3). Everything after `--` goes to the benchmark;
# see `python/bench/bench_torch_peers.py --help`.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_version=2.15.0
transformers_version=5.24.0
deepspeed_version=0.19.8

venv=/tmp/strata-peers-venv
strata_python=build/python
install_only=0
bench_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --strata-python) strata_python="$2"; shift 2 ;;
    --install-only) install_only=1; shift ;;
    --) shift; bench_args=("$@"); break ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "bench-torch-peers.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

python="$venv/bin/python"
pins_ok() {
  [[ -x "$python" ]] && "$python" - "$torch_version" "$transformers_version" "$deepspeed_version" <<'EOF' 2>/dev/null
import sys, importlib.metadata as md
want = dict(zip(["torch", "transformers", "deepspeed"], sys.argv[1:]))
for name, version in want.items():
    have = md.version(name)
    if have.split("+")[0] != version:
        sys.exit(f"{name} {have} != {version}")
import torch, transformers, numpy  # the imports themselves must work
EOF
}

if pins_ok; then
  echo "== peers venv $venv: pinned versions already installed, skipping pip"
else
  echo "== creating peers venv $venv (from /usr/bin/python3, no system site-packages)"
  [[ -x "$python" ]] || /usr/bin/python3 -m venv "$venv"
  "$python" -m pip install --upgrade pip setuptools wheel
  "$python" -m pip install "torch==$torch_version" "transformers==$transformers_version" numpy \
    ninja py-cpuinfo psutil pydantic packaging tqdm hjson msgpack einops
  # DeepSpeed's setup.py imports torch, so build it against the venv's torch
  # (no build isolation); DS_BUILD_OPS=0 leaves every op to the JIT builder.
  DS_BUILD_OPS=0 "$python" -m pip install --no-build-isolation "deepspeed==$deepspeed_version"
  pins_ok || { echo "bench-torch-peers.sh: $venv still lacks the pinned torch/transformers/deepspeed after pip" >&2; exit 1; }
fi

if [[ ! -d "$strata_python/strata" ]]; then
  echo "bench-torch-peers.sh: no staged strata package at $strata_python/strata (build it with scripts/build.sh, or pass --strata-python DIR)" >&2
  exit 1
fi
[[ $install_only == 1 ]] && exit 0

export DS_ACCELERATOR=cpu
export OMP_WAIT_POLICY=passive
export PYTHONPATH="$(cd "$strata_python" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'); load before: $(uptime)"
status=0
"$python" python/bench/bench_torch_peers.py "${bench_args[@]}" || status=$?
echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC'); load after: $(uptime)"
exit $status
