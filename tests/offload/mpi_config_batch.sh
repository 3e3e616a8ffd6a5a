#!/bin/sh
# A DeepSpeed-shaped config under mpirun (issue 22, defect 14): all three
# batch keys, train_batch_size = micro batch x accumulation x 2, trains with
# `mpirun -np 2 strata train --backend mpi` (the batch keys are checked
# against the MPI communicator's world, not 1), with the losses of the same
# config on two local ranks; a train_batch_size that does not multiply out
# with 2 ranks is refused, showing the arithmetic and where the world size
# came from.
# Usage: mpi_config_batch.sh STRATA MPIRUN WORKDIR
set -eu
strata=$1 mpirun=$2 dir=$3
rm -rf "$dir"
mkdir -p "$dir"
config() {  # config FILE TRAIN_BATCH_SIZE
  cat > "$1" <<JSON
{
  "train_batch_size": $2,
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "optimizer": { "type": "AdamW", "params": { "lr": 3e-3 } },
  "zero_optimization": { "stage": 2, "offload_optimizer": { "device": "cpu" } }
}
JSON
}
config "$dir/ds.json" 8
config "$dir/bad.json" 4
args="--preset tiny --seq 32 --steps 2 --eval-every 0 --eval-batches 1 --quiet"
mpi="$mpirun --allow-run-as-root --oversubscribe -np 2"
losses() { sed -n 's/.*"loss":\([^,]*\),"val_loss":\([^,]*\),.*/\1 \2/p' "$1"; }

$mpi "$strata" train $args --backend mpi --config "$dir/ds.json" --json-log "$dir/mpi.jsonl" > "$dir/mpi.out" 2>&1 ||
  { cat "$dir/mpi.out"; echo "FAIL: mpirun -np 2 refused train_batch_size 8 = 2 x 2 x 2"; exit 1; }
grep -q "batch 2 x seq 32 x accum 2 x ranks 2" "$dir/mpi.out" ||
  { cat "$dir/mpi.out"; echo "FAIL: the run is not micro batch 2 x accumulation 2 x 2 ranks"; exit 1; }
"$strata" train $args --ranks 2 --config "$dir/ds.json" --json-log "$dir/local.jsonl" > "$dir/local.out" 2>&1 ||
  { cat "$dir/local.out"; echo "FAIL: --ranks 2 refused the config"; exit 1; }
losses "$dir/mpi.jsonl" > "$dir/mpi.txt"
losses "$dir/local.jsonl" > "$dir/local.txt"
test "$(wc -l < "$dir/mpi.txt")" -eq 2 || { echo "FAIL: expected 2 steps in $dir/mpi.jsonl"; exit 1; }
cmp "$dir/local.txt" "$dir/mpi.txt" ||
  { echo "FAIL: mpi -np 2 differs from 2 local ranks"; paste "$dir/local.txt" "$dir/mpi.txt"; exit 1; }

if $mpi "$strata" train $args --backend mpi --config "$dir/bad.json" > "$dir/bad.out" 2>&1; then
  cat "$dir/bad.out"; echo "FAIL: train_batch_size 4 with micro batch 2 x accumulation 2 x 2 ranks was accepted"; exit 1
fi
want="train_batch_size 4 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 2 x world size 2 = 8 (world size 2 from the MPI communicator (mpirun -np 2))"
grep -qF "$want" "$dir/bad.out" || { cat "$dir/bad.out"; echo "FAIL: the refusal does not say: $want"; exit 1; }
grep -q "hint: set train_batch_size to 8" "$dir/bad.out" || { cat "$dir/bad.out"; echo "FAIL: no hint"; exit 1; }
echo "mpi config batch OK: train_batch_size 8 = 2 x 2 x world 2 trains under mpirun (losses = 2 local ranks); 4 is refused naming the world"
