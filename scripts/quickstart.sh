#!/usr/bin/env bash
# Installs dependencies, builds Strata, and runs the main job on embedded
# defaults (no GPU needed): the environment report, a memory estimate for a
# 7B model, and a short training run of a small GPT on the cpu device with
# the shipped corpus, through the ZeRO engine at stage 3 with the optimizer
# state and the parameter shards on NVMe (swap files under $STRATA_NVME_DIR,
# default $TMPDIR or /tmp, removed at exit), a device cap and a host-memory
# budget both smaller than the model's training state
# (examples/configs/zero3-nvme.json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# Only the CLI the main job runs (the tests, fuzz targets and benchmarks are
# test-all.sh's), compiled with test-all.sh's flags so that its build reuses
# these objects. A new build folder is made for Ninja, which keeps both cores
# busy where make's per-target order leaves one idle (the build 4:02 instead
# of 4:40 on 2 cores, 2026-12-06); a folder that exists keeps its generator.
generator=()
if command -v ninja > /dev/null && [[ ! -f build/CMakeCache.txt ]]; then generator=(-G Ninja); fi
STRATA_BUILD_DIR=build STRATA_BUILD_TARGETS=strata_cli scripts/build.sh "${generator[@]}" \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
strata=build/apps/strata
echo "== strata report"
"$strata" report
echo "== strata estimate --params 7B --gpus-per-node 8"
"$strata" estimate --params 7B --gpus-per-node 8
echo "== strata train (stage 3, optimizer and parameters on NVMe, device cap and host budget below the model state)"
nvme_dir="${STRATA_NVME_DIR:-${TMPDIR:-/tmp}}"
"$strata" train --config examples/configs/zero3-nvme.json --nvme-path "$nvme_dir" --embd 128 --seq 32 --steps 300 \
  --eval-every 100
