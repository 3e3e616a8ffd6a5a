#!/bin/sh
# Atomic steps under mpirun (two processes, the vote over MPI): one EIO in
# each rank's optimizer-state write-backs (STRATA_FAULTS, every rank, read by
# the test-only strata-testing; the fault-free run is the release strata) fails a
# step's update (one step, or two when the ranks' faults land in different
# steps); every rank rolls back, --step-retries 2 repeats them, and the
# run ends with the losses of a fault-free run bit for bit (the JSON log's
# last line per step, after its rollback record).
# Usage: mpi_step_retry.sh STRATA STRATA_TESTING MPIRUN WORKDIR
set -eu
strata=$1 strata_testing=$2 mpirun=$3 dir=$4
rm -rf "$dir"
mkdir -p "$dir/nvme"
args="--preset tiny --steps 6 --seq 32 --batch 4 --eval-every 0 --eval-batches 1 --quiet --backend mpi --stage 2"
args="$args --offload-optimizer nvme --nvme-path $dir/nvme"
mpi="$mpirun --allow-run-as-root --oversubscribe -np 2"
# Per step, the last line wins (a rolled-back step is logged again when repeated).
losses() { sed -n 's/^{"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1" | awk '{ last[$1] = $2 } END { for (s in last) print s, last[s] }' | sort -n; }
$mpi "$strata" train $args --json-log "$dir/straight.jsonl"
$mpi -x STRATA_FAULTS=eio=1,reads=0,after=8,count=1 "$strata_testing" train $args --step-retries 2 --json-log "$dir/faulty.jsonl"
grep -q '^{"rollback":' "$dir/faulty.jsonl" || { echo "no rollback record in $dir/faulty.jsonl"; exit 1; }
losses "$dir/straight.jsonl" > "$dir/straight.txt"
losses "$dir/faulty.jsonl" > "$dir/faulty.txt"
test "$(wc -l < "$dir/faulty.txt")" -eq 6 || { echo "expected steps 1..6 in $dir/faulty.jsonl"; exit 1; }
cmp "$dir/straight.txt" "$dir/faulty.txt" || { echo "the repeated run differs"; paste "$dir/straight.txt" "$dir/faulty.txt"; exit 1; }
echo "mpi step retry OK: a step rolled back on both processes and repeated; losses bit-identical to a fault-free run"
