#!/usr/bin/env bash
# Issue 12's capacity run: gpt2 dimensions with 15 blocks and a byte vocabulary (106M
# parameters, 16 B/param of training state with bf16 = 1.70 GB) trains with the optimizer state on
# NVMe and the parameter shards in host memory, under a device cap of 1/8 of
# the state (212 MB) and a host budget of 1/2 (850 MB), and gives the same
# losses as an uncapped stage-0 run of the same model and batch.
# Usage: bench/engine/capacity.sh STRATA NVME_DIR [STEPS]
set -euo pipefail
strata=$1 nvme=$2 steps=${3:-20}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--preset gpt2 --vocab 256 --layers 15 --seq 32 --batch 1 --steps "$steps" --eval-every 0 --quiet)
echo "== capped: stage 3, optimizer on NVMe ($nvme), params in host memory, device 212 MB, host budget 850 MB"
/usr/bin/time -f "wall %e s, max RSS %M KiB" "$strata" train "${common[@]}" --config "$here/capacity-nvme.json" \
  --nvme-path "$nvme" --json-log "$out/capped.jsonl" | tail -3
echo "== reference: stage 0, everything on the (uncapped) cpu device"
/usr/bin/time -f "wall %e s, max RSS %M KiB" "$strata" train "${common[@]}" --dtype bf16 --lr 3e-4 --weight-decay 0.01 \
  --device-memory 8GiB --json-log "$out/ref.jsonl" | tail -3
sed -n 's/.*"loss":\([^,]*\),.*/\1/p' "$out/capped.jsonl" > "$out/capped.txt"
sed -n 's/.*"loss":\([^,]*\),.*/\1/p' "$out/ref.jsonl" > "$out/ref.txt"
paste "$out/capped.txt" "$out/ref.txt" | head -5
if cmp -s "$out/capped.txt" "$out/ref.txt"; then echo "losses: identical over $steps steps"; else echo "losses DIFFER"; exit 1; fi
grep -o '"peak_bytes":{[^}]*}' "$out/capped.jsonl" | tail -1
