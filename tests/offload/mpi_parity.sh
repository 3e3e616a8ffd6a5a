#!/bin/sh
# `mpirun -np 2 strata train --backend mpi` against `strata train --ranks 2`
# (local): the same global batch on both, so the losses must agree bit for
# bit (a sum of two fp32 values does not depend on their order), and stage 3
# with cpu offload under mpi must match stage 0 under mpi.
# Usage: mpi_parity.sh STRATA MPIRUN WORKDIR
set -eu
strata=$1 mpirun=$2 dir=$3
mkdir -p "$dir"
args="--preset tiny --steps 12 --batch 4 --seq 32 --grad-accum 2 --eval-every 6 --quiet --lr 0.003"
losses() { sed -n 's/.*"loss":\([^,]*\),"val_loss":\([^,]*\),.*/\1 \2/p' "$1"; }
"$strata" train $args --ranks 2 --stage 3 --offload-optimizer cpu --json-log "$dir/local.jsonl"
"$mpirun" --allow-run-as-root --oversubscribe -np 2 "$strata" train $args --backend mpi --stage 3 \
  --offload-optimizer cpu --offload-param cpu --json-log "$dir/mpi3.jsonl"
"$mpirun" --allow-run-as-root --oversubscribe -np 2 "$strata" train $args --backend mpi --stage 0 \
  --json-log "$dir/mpi0.jsonl"
losses "$dir/local.jsonl" > "$dir/local.txt"
losses "$dir/mpi3.jsonl" > "$dir/mpi3.txt"
losses "$dir/mpi0.jsonl" > "$dir/mpi0.txt"
test "$(wc -l < "$dir/local.txt")" -eq 12 || { echo "expected 12 steps in $dir/local.jsonl"; exit 1; }
cmp "$dir/local.txt" "$dir/mpi3.txt" || { echo "mpi stage 3 differs from local ranks"; paste "$dir/local.txt" "$dir/mpi3.txt"; exit 1; }
cmp "$dir/mpi0.txt" "$dir/mpi3.txt" || { echo "mpi stage 0 differs from mpi stage 3"; paste "$dir/mpi0.txt" "$dir/mpi3.txt"; exit 1; }
echo "mpi parity OK: 12 steps bit-identical (local 2 ranks = mpi -np 2, stage 0 = stage 3 + cpu offload)"
