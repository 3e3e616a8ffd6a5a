#!/usr/bin/env bash
# Installs dependencies, builds Strata, and runs the main job on embedded
# defaults (no GPU needed): the environment report, a memory estimate for a
# 7B model, and a short training run of the tiny GPT preset on the cpu
# device with the shipped corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
STRATA_BUILD_DIR=build scripts/build.sh
strata=build/apps/strata
echo "== strata report"
"$strata" report
echo "== strata estimate --params 7B --gpus-per-node 8"
"$strata" estimate --params 7B --gpus-per-node 8
echo "== strata train (tiny preset, cpu device, embedded defaults)"
"$strata" train
