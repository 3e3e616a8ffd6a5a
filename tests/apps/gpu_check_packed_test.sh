#!/usr/bin/env bash
# scripts/gpu-pack.sh packs this build's GPU programs, and scripts/gpu-check.sh
# runs the packed ones (docs/gpu-results.md). Without a GPU the check must say
# so (status no_gpu), exit 0, run the device suite's cpu cases from the pack
# and bundle its outputs; bad input (no CUDA build, no archive) is refused.
# Usage: gpu_check_packed_test.sh BUILD_DIR SOURCE_DIR
set -uo pipefail
build=$1 source=$2
work=$(mktemp -d "$build/gpu-pack-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# Bad input first: a folder that is no CUDA build, an archive that is not there.
mkdir -p "$work/not-a-build"
"$source/scripts/gpu-pack.sh" "$work/not-a-build" "$work/x.tar.xz" > "$work/bad.log" 2>&1 &&
  fail "gpu-pack.sh accepted a folder that is no build"
grep -q "is not a build configured with STRATA_ENABLE_CUDA=ON" "$work/bad.log" || fail "unclear error: $(cat "$work/bad.log")"
STRATA_GPU_PACK="$work/missing.tar.xz" OUT="$work/missing-out" "$source/scripts/gpu-check.sh" > "$work/bad.log" 2>&1
[[ $? -eq 1 ]] || fail "gpu-check.sh did not exit 1 for a missing pack"
grep -q "could not unpack" "$work/bad.log" || fail "unclear error: $(cat "$work/bad.log")"

# The pack and the check on this machine (no GPU: CI has none).
XZ_OPT=-0 "$source/scripts/gpu-pack.sh" "$build" "$work/pack.tar.xz" || fail "gpu-pack.sh failed"
tar -tJf "$work/pack.tar.xz" > "$work/pack.list" || fail "the pack does not list"
grep -q "strata-gpu/bin/strata_device_adam_tests" "$work/pack.list" || fail "the pack lacks a test program"
grep -q "strata-gpu/lib/libstrata_offload.so" "$work/pack.list" || fail "the pack lacks the engine library"
grep -q "libnccl" "$work/pack.list" && fail "the pack holds NCCL (the GPU machine has its own)"
STRATA_GPU_PACK="$work/pack.tar.xz" STRATA_GPU_CHECK_BUNDLE="$work/bundle.tgz" OUT="$work/out" \
  "$source/scripts/gpu-check.sh" || fail "gpu-check.sh on the pack exited $?"
grep -q '"status": "no_gpu"' "$work/out/summary.json" || fail "summary: $(cat "$work/out/summary.json")"
grep -q '"device_suite_rc_without_gpu": 0' "$work/out/summary.json" || fail "the device suite failed from the pack"
tar -tzf "$work/bundle.tgz" > "$work/bundle.list" || fail "the bundle does not list"
grep -q "summary.json" "$work/bundle.list" || fail "the bundle lacks summary.json"
# strata.torch's native module (issue 50 §2), packed when the build has one: without a GPU it must load
# from the pack with this machine's python3 (or the check says which Python the module is for).
if compgen -G "$build/python/strata/_native*.so" > /dev/null; then
  module=$(basename "$(ls "$build"/python/strata/_native*.so | head -1)")
  grep -q "strata-gpu/python/$module" "$work/pack.list" || fail "the pack lacks strata.torch's module $module"
  grep -q "strata-gpu/python/lib/libstrata_offload.so" "$work/pack.list" || fail "the pack lacks the module's engine library"
  suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  if [[ "$module" == "_native$suffix" ]]; then
    grep -q '"torch": "skipped: no GPU; the packed module loads (strata ' "$work/out/summary.json" ||
      fail "the packed strata.torch module did not load: $(grep '"torch"' "$work/out/summary.json")"
  else
    grep -q "\"torch\": \"not run: the packed module is $module" "$work/out/summary.json" ||
      fail "a module for another Python was not named: $(grep '"torch"' "$work/out/summary.json")"
  fi
fi
echo "gpu-check ran the packed programs"
