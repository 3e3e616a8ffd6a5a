#!/usr/bin/env bash
# Issue 24 §3's capacity run: host memory that does not grow with the model.
# gpt2 dimensions with a byte vocabulary, 15 blocks (106M parameters) and 60
# blocks (4x: 424M), each trained with the optimizer state, the parameter
# shards and the reduced gradient shards on NVMe (capacity-bounded.json:
# strata.gradient_shards auto puts them there because the pinned plan does
# not fit), under the SAME host budget (96 MB: under 1 B per parameter of the
# smaller model, slots included) and a device cap of 1/8 of each model's
# training state, against an uncapped stage-0 run of the same model and batch:
# the losses must be identical.
# Usage: bench/engine/capacity_bounded.sh STRATA NVME_DIR [STEPS] [LAYERS...]
set -euo pipefail
strata=$1 nvme=$2 steps=${3:-5}
shift $(( $# < 3 ? $# : 3 ))
layer_counts=("$@")
[ ${#layer_counts[@]} -gt 0 ] || layer_counts=(15 60)
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for layers in "${layer_counts[@]}"; do
  common=(--preset gpt2 --vocab 256 --layers "$layers" --seq 32 --batch 1 --steps "$steps" --eval-every 0 --quiet)
  # 16 B per parameter of training state (bf16); the device gets 1/8 of it.
  params=$("$strata" estimate --model gpt2 --vocab 256 --layers "$layers" | sed -n 's/^Model: \([0-9.]*\)M parameters.*/\1/p')
  device=$(python3 -c "print(int($params * 1e6 * 16 / 8))")
  echo "== $layers blocks (${params}M parameters): stage 3, optimizer, parameters and gradients on NVMe ($nvme), device ${device} B, host budget 96 MB"
  /usr/bin/time -f "wall %e s, max RSS %M KiB" "$strata" train "${common[@]}" --config "$here/capacity-bounded.json" \
    --nvme-path "$nvme" --device-memory "$device" --json-log "$out/capped.jsonl" | tail -2
  echo "== reference: stage 0, everything on the (uncapped) cpu device"
  /usr/bin/time -f "wall %e s, max RSS %M KiB" "$strata" train "${common[@]}" --dtype bf16 --lr 3e-4 --weight-decay 0.01 \
    --device-memory 16GiB --json-log "$out/ref.jsonl" | tail -2
  sed -n 's/.*"loss":\([^,]*\),.*/\1/p' "$out/capped.jsonl" > "$out/capped.txt"
  sed -n 's/.*"loss":\([^,]*\),.*/\1/p' "$out/ref.jsonl" > "$out/ref.txt"
  paste "$out/capped.txt" "$out/ref.txt" | head -3
  if cmp -s "$out/capped.txt" "$out/ref.txt"; then echo "losses: identical over $steps steps"; else echo "losses DIFFER"; exit 1; fi
  peak=$(grep -o '"pinned":[0-9]*' "$out/capped.jsonl" | tail -1 | cut -d: -f2)
  python3 -c "print(f'pinned peak {$peak / 2**20:.2f} MiB = {$peak / ($params * 1e6):.3f} B per parameter')"
  grep -o '"peak_bytes":{[^}]*}' "$out/capped.jsonl" | tail -1
done
