#!/usr/bin/env bash
# The performance bar (issue 4, ceiling made honest in issue 9: a pure
# streaming probe of the same bytes, bar >= 0.95), measured: `strata bench cpu-adam` for the
# dtype mixes x thread counts, each run ROUNDS times (each run is itself the
# median of --reps interleaved step/probe pairs); prints the median ratio,
# min and max per row. On a shared machine, read the spread too.
#   bench/cpu_adam/ratio_matrix.sh build/apps/strata [PARAMS=64M] [ROUNDS=3]
set -euo pipefail
strata="${1:?usage: ratio_matrix.sh path/to/strata [params] [rounds]}"
params="${2:-64M}"
rounds="${3:-3}"
mixes=(
  "adamw fp32 fp32 none"
  "adamw bf16 fp32 bf16"
  "adamw fp16 fp32 fp16"
  "adamw bf16 bf16 bf16"
  "adam fp32 fp32 none"
  "adagrad fp32 fp32 none"
  "lion bf16 fp32 bf16"
)
printf "%-8s %-5s %-7s %-5s %-7s %12s %12s %12s %s\n" kernel grads moments copy threads "Gparam/s" "GB/s" "ceil GB/s" "ratio median [min, max]"
for mix in "${mixes[@]}"; do
  read -r kernel grad moment copy <<<"$mix"
  for threads in 1 2; do
    results=()
    for ((r = 0; r < rounds; r++)); do
      results+=("$("$strata" bench cpu-adam --kernel "$kernel" --grad-dtype "$grad" --moment-dtype "$moment" \
        --param-copy "$copy" --threads "$threads" --params "$params" --json)")
    done
    printf '%s\n' "${results[@]}" | python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
ratios = sorted(r["ratio"] for r in rows)
med = statistics.median(ratios)
pick = min(rows, key=lambda r: abs(r["ratio"] - med))
print("%12.3f %12.2f %12.2f   %.3f [%.3f, %.3f]" % (pick["params_per_second"] / 1e9, pick["bytes_per_second"] / 1e9,
      pick["ceiling_bytes_per_second"] / 1e9, med, ratios[0], ratios[-1]))' | sed "s/^/$(printf "%-8s %-5s %-7s %-5s %-7s" "$kernel" "$grad" "$moment" "$copy" "$threads")/"
  done
done
