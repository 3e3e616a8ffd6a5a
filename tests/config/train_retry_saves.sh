#!/bin/sh
# train_retry_saves.sh STRATA_TESTING NVME_DIR CKPT_DIR: a run saving every step
# whose step 2 update loses one NVMe write (STRATA_FAULTS, set by the test and
# read by the test-only strata-testing binary) is
# rolled back and repeated (--step-retries 1); it must end with the losses of
# a fault-free run, leave a verifiable last checkpoint and no .tmp-* folder
# (the failed save's attempt is replaced when the tag is saved again).
set -eu
strata=$1 nvme=$2 ckpt=$3
rm -rf "$ckpt"
mkdir -p "$nvme"
out=$("$strata" train --preset tiny --stage 2 --offload-optimizer nvme --nvme-path "$nvme" --steps 6 \
  --step-retries 1 --eval-every 0 --save-dir "$ckpt" --save-every 1 2>&1)
printf '%s\n' "$out"
printf '%s\n' "$out" | grep -q '^retry    step 3 failed; every rank is at the state after step 1' ||
  { echo "FAIL: no rolled-back step in the log"; exit 1; }
printf '%s\n' "$out" | grep -Fq 'step     6/6 | loss 4.7923 | val 4.8400' ||
  { echo "FAIL: the losses differ from a fault-free run"; exit 1; }
"$strata" checkpoint verify "$ckpt" | grep -q "global_step6': 2 files" || { echo "FAIL: latest is not step 6"; exit 1; }
if ls -a "$ckpt" | grep -q '^\.tmp-'; then echo "FAIL: a .tmp-* folder was left"; ls -a "$ckpt"; exit 1; fi
echo PASS
