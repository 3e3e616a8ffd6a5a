#!/usr/bin/env bash
# Issue 24 §2's capacity run: how many parameters one host budget holds with
# fp32 and with 8-bit (int8) Adam moments. gpt2 dimensions with a byte
# vocabulary; stage 3 with the optimizer state in pinned host memory (the
# state is what the budget holds), the parameter shards and the reduced
# gradient shards on NVMe (capacity-moments.json: strata.gradient_shards nvme
# in the parameter shards' folder). For each moment storage the script adds
# blocks until `strata train` refuses the plan against
# strata.host_memory_budget (the engine refuses before allocating), then
# trains the largest model that fitted for STEPS steps under the budget and
# prints its pinned peak (= the plan) and the parameter ratio int8 / fp32.
# Usage: bench/engine/capacity_moments.sh STRATA NVME_DIR [BUDGET] [STEPS]
set -euo pipefail
strata=$1 nvme=$2 budget=${3:-400MB} steps=${4:-5}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--preset gpt2 --vocab 256 --seq 32 --batch 1 --eval-every 0 --quiet --nvme-path "$nvme" --device-memory 4GiB)
declare -A largest params
for moments in fp32 int8; do
  python3 - "$here/capacity-moments.json" "$out/$moments.json" "$moments" "$budget" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["strata"]["optimizer_state_dtype"] = sys.argv[3]
c["strata"]["host_memory_budget"] = sys.argv[4]
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
  fits=0
  for layers in $(seq 1 200); do
    if "$strata" train "${common[@]}" --layers "$layers" --steps 1 --config "$out/$moments.json" >"$out/try.txt" 2>&1; then
      fits=$layers
    elif grep -q "host_memory_budget" "$out/try.txt"; then
      echo "$moments: $layers blocks refused: $(grep -o "needs [0-9.]* [KMG]iB of pinned memory[^;]*" "$out/try.txt" | head -1)"
      break
    else
      cat "$out/try.txt"; exit 1
    fi
  done
  [ "$fits" -gt 0 ] || { echo "$moments: not even one block fits $budget"; exit 1; }
  largest[$moments]=$fits
  params[$moments]=$("$strata" estimate --model gpt2 --vocab 256 --layers "$fits" | sed -n 's/^Model: \([0-9.]*\)M parameters.*/\1/p')
  echo "== $moments moments: $fits blocks (${params[$moments]}M parameters) fit $budget; training $steps steps"
  /usr/bin/time -f "wall %e s, max RSS %M KiB" "$strata" train "${common[@]}" --layers "$fits" --steps "$steps" \
    --config "$out/$moments.json" --json-log "$out/$moments.jsonl" | tail -3
  sed -n 's/.*"loss":\([^,]*\),.*/\1/p' "$out/$moments.jsonl" | tr '\n' ' '; echo
  peak=$(grep -o '"pinned":[0-9]*' "$out/$moments.jsonl" | tail -1 | cut -d: -f2)
  python3 -c "print(f'pinned peak {$peak / 2**20:.2f} MiB = {$peak / (${params[$moments]} * 1e6):.2f} B per parameter')"
done
python3 -c "print(f'int8 / fp32 parameters under $budget: ${params[int8]} / ${params[fp32]} = {${params[int8]} / ${params[fp32]}:.2f}x')"
