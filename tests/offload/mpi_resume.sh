#!/bin/sh
# Checkpoints under mpirun (two processes, each writing only its own files,
# rank 0 committing): a run resumed from step 3 under mpirun continues with
# the losses of the straight run bit for bit; the same checkpoint loads into
# one local rank (reshard 2 -> 1, stage 3 -> 0) and agrees within 1e-5.
# Usage: mpi_resume.sh STRATA MPIRUN WORKDIR
set -eu
strata=$1 mpirun=$2 dir=$3
rm -rf "$dir"
mkdir -p "$dir"
args="--preset tiny --steps 6 --seq 32 --grad-accum 2 --eval-every 0 --eval-batches 1 --quiet --lr 0.003"
mpi="$mpirun --allow-run-as-root --oversubscribe -np 2 $strata train $args --batch 4 --backend mpi --stage 3 --offload-optimizer cpu"
losses() { sed -n 's/^{"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1"; }
$mpi --save-dir "$dir/ck" --save-every 3 --json-log "$dir/straight.jsonl"
test -f "$dir/ck/global_step3/manifest.json" || { echo "no committed checkpoint at step 3"; exit 1; }
"$strata" checkpoint verify "$dir/ck/global_step3"
$mpi --resume "$dir/ck/global_step3" --json-log "$dir/resumed.jsonl"
losses "$dir/straight.jsonl" | tail -n 3 > "$dir/straight.txt"
losses "$dir/resumed.jsonl" > "$dir/resumed.txt"
test "$(wc -l < "$dir/resumed.txt")" -eq 3 || { echo "expected steps 4..6 in $dir/resumed.jsonl"; exit 1; }
cmp "$dir/straight.txt" "$dir/resumed.txt" || { echo "resumed under mpirun differs"; paste "$dir/straight.txt" "$dir/resumed.txt"; exit 1; }
"$strata" train $args --batch 8 --ranks 1 --resume "$dir/ck/global_step3" --json-log "$dir/reshard.jsonl"
losses "$dir/reshard.jsonl" > "$dir/reshard.txt"
paste "$dir/straight.txt" "$dir/reshard.txt" | awk '{ d = ($2 - $4) / $2; if (d < 0) d = -d; if (d > 1e-5 || $1 != $3) { print "reshard 2 -> 1 differs at step " $1 ": " $2 " vs " $4; bad = 1 } } END { exit bad }'
echo "mpi resume OK: steps 4..6 bit-identical after a resume under mpirun; reshard 2 -> 1 within 1e-5"
