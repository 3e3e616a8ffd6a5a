#!/usr/bin/env bash
# What strata.gradient_shards nvme costs (Note [Gradient shards on NVMe]):
# the same run with the reduced gradient shards pinned (A) and on NVMe (B),
# in interleaved pairs (ABBA), printing each run's median step time, pinned
# peak and NVMe bytes per step (from --json-log), then the B/A ratios.
# Usage: bench/engine/gradient_shards_cost.sh STRATA NVME_DIR [PAIRS] [-- extra strata train flags]
set -euo pipefail
strata=$1 nvme=$2 pairs=${3:-4}
shift $(( $# < 3 ? $# : 3 ))
[ "${1:-}" = "--" ] && shift
extra=("$@")
[ ${#extra[@]} -gt 0 ] || extra=(--preset small --seq 16 --batch 1 --steps 12)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
config() {  # $1: pinned | nvme
  cat > "$out/$1.json" <<JSON
{"bf16": {"enabled": true},
 "zero_optimization": {"stage": 3, "sub_group_size": 2000000,
   "offload_optimizer": {"device": "nvme", "nvme_path": "$nvme", "buffer_count": 4,
                         "pipeline_read": true, "pipeline_write": true},
   "offload_param": {"device": "nvme", "nvme_path": "$nvme", "max_in_cpu": 0, "buffer_count": 2}},
 "train_micro_batch_size_per_gpu": 1, "strata": {"gradient_shards": "$1"}}
JSON
}
config pinned
config nvme
run() {  # $1: pinned | nvme; prints "median_step_ms pinned_peak_MiB nvme_read_MB nvme_write_MB"
  "$strata" train "${extra[@]}" --eval-every 0 --quiet --config "$out/$1.json" --json-log "$out/log.jsonl" > /dev/null
  python3 - "$out/log.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]  # the first two steps warm up
print(f"{statistics.median(r['step_ms'] for r in rows):.1f} {max(r['peak_bytes']['pinned'] for r in rows) / 2**20:.2f} "
      f"{statistics.median(r['bytes']['nvme_read'] for r in rows) / 1e6:.1f} {statistics.median(r['bytes']['nvme_write'] for r in rows) / 1e6:.1f}")
PY
}
echo "pair order mode step_ms pinned_MiB nvme_read_MB nvme_write_MB"
for p in $(seq 1 "$pairs"); do
  if [ $((p % 2)) -eq 1 ]; then order=(pinned nvme); else order=(nvme pinned); fi
  for mode in "${order[@]}"; do echo "$p ${order[0]}-first $mode $(run "$mode")"; done
done | tee "$out/pairs.txt"
python3 - "$out/pairs.txt" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l[0].isdigit()]
by = {}
for r in rows: by.setdefault(r[0], {})[r[2]] = float(r[3])
ratios = [v['nvme'] / v['pinned'] for v in by.values()]
print("step time nvme/pinned per pair:", " ".join(f"{x:.3f}" for x in ratios))
PY
