#!/usr/bin/env bash
# Issue 24 §2's convergence evidence: the `small` preset trained STEPS steps
# (ZeRO-2, optimizer state in pinned host memory, bf16, AdamW + warmup-cosine)
# with fp32, bf16 and int8 optimizer moments (strata.optimizer_state_dtype),
# same seed and data, the three side by side; once per seed in SEEDS; then the
# curves as a PNG and the final losses per seed with their spread.
# Validation every 100 steps on EVAL_BATCHES batches (default 32: on 8, one
# run's loss moved by 1.5 % between 8 and 32 batches, docs/performance.md).
# A run whose log already holds STEPS steps is kept, not run again, so an
# interrupted or extended call (more seeds) redoes only what is missing.
# Usage: bench/engine/moment_convergence.sh STRATA OUT_DIR [STEPS] [PNG] [EVAL_BATCHES] [SEEDS]
#   SEEDS: comma-separated, default 1234; logs are OUT_DIR/<moments>-s<seed>.jsonl
set -euo pipefail
strata=$1 out=$2 steps=${3:-2000} png=${4:-$out/moment-convergence.png} eval_batches=${5:-32} seeds=${6:-1234}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
[[ "$seeds" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "moment_convergence.sh: SEEDS '$seeds' is not a comma-separated list of numbers" >&2; exit 2; }
for m in fp32 bf16 int8; do
  cat > "$out/cfg-$m.json" <<JSON
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
 "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100, "total_num_steps": $steps,
               "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
 "strata": {"device": "cpu", "optimizer_state_dtype": "$m"}}
JSON
done
complete() {  # the log holds every step
  [[ -f "$1" ]] && [[ $(grep -c '"step"' "$1") -ge $steps ]]
}
for seed in ${seeds//,/ }; do
  for m in fp32 bf16 int8; do
    log="$out/$m-s$seed.jsonl"
    if complete "$log"; then echo "kept $log"; continue; fi
    "$strata" train --preset small --seq 16 --steps "$steps" --eval-every 100 --eval-batches "$eval_batches" \
      --seed "$seed" --optimizer-threads 1 --device-threads 1 --config "$out/cfg-$m.json" --json-log "$log" \
      --quiet > "$out/$m-s$seed.log" 2>&1 &
  done
  wait
done
# The plot needs matplotlib: Debian's python3-matplotlib belongs to /usr/bin/python3.
plot_python=python3
python3 -c "import matplotlib" 2> /dev/null || plot_python=/usr/bin/python3
"$plot_python" "$here/plot_moment_convergence.py" "$out" "$png" "$eval_batches"
