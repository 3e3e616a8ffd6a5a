#!/usr/bin/env bash
# GPU check: configure + build with CUDA into build-gpu (or run the programs
# that scripts/gpu-pack.sh packed on another machine), run every test that
# needs a GPU (selected by name), then the device copy benchmarks (pinned vs
# pageable, H2D/D2H) on the cuda backend, the device Adam kernel's benchmark
# and the engine on cuda. Writes logs and summary.json under $OUT (default
# ./gpu-check-out).
#
#   scripts/gpu-check.sh            # exit 0 when every GPU test passed, or when there is no GPU
#   STRATA_GPU_REQUIRED=1 scripts/gpu-check.sh   # "no GPU" is a failure (exit 3)
#   STRATA_GPU_CHECK_QUICK=1 ...    # shorter benchmarks
#   STRATA_GPU_PACK=.gpu-pack/strata-gpu.tar.xz ...  # no build: run the packed programs
#   STRATA_GPU_CHECK_BUNDLE=FILE ...  # also write every output file into one .tar.gz
#   STRATA_GPU_PEER_WHEELS=.gpu-pack/peer-wheels ...  # also the peer, DeepSpeed (step 10;
#                                   # scripts/gpu-peer-wheels.sh makes the folder)
#   STRATA_GPU_PEER_ONLY=1 ...      # with the above: the peer alone, after the GPU probe
#   STRATA_GPU_TORCH_ONLY=1 ...     # strata.torch alone (its matrix and headline run,
#                                   # scripts/gpu-torch-check.py) with the pack's native
#                                   # module, then the peer if its wheels are given
#
# Exit codes: 0 ok / no GPU, 1 configure or build failed, 2 a GPU test or
# benchmark failed, 3 no GPU with STRATA_GPU_REQUIRED=1.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out="${OUT:-$root/gpu-check-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
build="${STRATA_GPU_BUILD_DIR:-build-gpu}"
jobs="${STRATA_JOBS:-$(nproc)}"
summary="$out/summary.json"
rm -f "$summary"  # a summary left by an earlier run is not this one's
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)

log() { echo "gpu-check: $*" | tee -a "$out/gpu-check.log"; }
json_escape() { sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | tr '\n' ' '; }

nvidia_smi_list() {
  if command -v nvidia-smi > /dev/null; then nvidia-smi -L 2>&1; else echo "nvidia-smi not installed"; fi
}

write_summary() {  # status, detail, then optional extra JSON members
  local status="$1" detail="$2" extra="${3:-}"
  {
    printf '{\n  "status": "%s",\n  "detail": "%s",\n' "$status" "$(printf '%s' "$detail" | json_escape)"
    printf '  "started": "%s",\n  "finished": "%s",\n' "$started" "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    printf '  "host": "%s",\n  "commit": "%s",\n' "$(hostname)" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    printf '  "nvidia_smi": "%s"' "$(nvidia_smi_list | json_escape)"
    [[ -n "$extra" ]] && printf ',\n%s' "$extra"
    printf '\n}\n'
  } > "$summary"
  log "summary: $summary (status $status)"
}

pack_dir=""
on_exit() {  # STRATA_GPU_CHECK_BUNDLE=FILE: every output file in one archive; the unpacked programs go
  # Ended before the summary (the outer timeout, say): one that says so, and where.
  [[ -f "$summary" ]] || write_summary "interrupted" "ended before the last step; the last log line: $(tail -1 "$out/gpu-check.log" 2> /dev/null)"
  [[ -n "${STRATA_GPU_CHECK_BUNDLE:-}" ]] && tar -C "$out" -czf "$STRATA_GPU_CHECK_BUNDLE" . 2> /dev/null
  [[ -n "$pack_dir" ]] && rm -rf "$pack_dir"
  [[ -n "${torch_stage:-}" ]] && rm -rf "$torch_stage"
  return 0
}
trap on_exit EXIT
trap 'exit 143' TERM INT  # so that a timeout still leaves the bundle
: > "$out/gpu-check.log"
log "output directory $out, build directory $build, $jobs jobs"
if command -v nvidia-smi > /dev/null; then nvidia-smi > "$out/nvidia-smi.txt" 2>&1; else echo "nvidia-smi not installed" > "$out/nvidia-smi.txt"; fi

# 1. The programs: packed ones (built elsewhere), or a CUDA build here.
build_rc=0
declare -A program  # file name -> path, for every program of scripts/gpu-programs.sh
source scripts/gpu-programs.sh
if [[ -n "${STRATA_GPU_PACK:-}" ]]; then
  pack_dir=$(mktemp -d)
  if ! tar -C "$pack_dir" -xJf "$STRATA_GPU_PACK" 2> "$out/unpack.log" &&
     ! python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
         "$STRATA_GPU_PACK" "$pack_dir" 2>> "$out/unpack.log"; then
    log "could not unpack $STRATA_GPU_PACK, see unpack.log"
    write_summary "build_failed" "unpacking $STRATA_GPU_PACK failed: $(tail -3 "$out/unpack.log")"
    exit 1
  fi
  bin="$pack_dir/strata-gpu/bin"
  for path in "${gpu_programs[@]}"; do program[$(basename "$path")]="$bin/$(basename "$path")"; done
  # NCCL and cuBLAS are not packed: take this machine's own (the CUDA
  # toolkit's, or the pip wheels beside torch).
  library_path="$pack_dir/strata-gpu/lib"
  for name in libnccl.so.2 libcublas.so.13 libcublasLt.so.13; do
    found=$(find /usr/local /opt /usr/lib -name "$name" 2> /dev/null | head -1)
    [[ -n "$found" && ":$library_path:" != *":$(dirname "$found"):"* ]] && library_path="$library_path:$(dirname "$found")"
    log "$name: ${found:-not found}"
  done
  # The packed libstdc++ only where this machine's is older than the one
  # the programs were linked against (g++ 12: GLIBCXX_3.4.30).
  system_libstdcxx=$(ldconfig -p 2> /dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  if [[ -z "$system_libstdcxx" ]] || ! grep -aq GLIBCXX_3.4.30 "$system_libstdcxx"; then
    library_path="$library_path:$pack_dir/strata-gpu/lib-fallback"
    log "using the packed libstdc++ (this machine's: ${system_libstdcxx:-none})"
  fi
  export LD_LIBRARY_PATH="$library_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "packed programs from commit $(cat "$pack_dir/strata-gpu/commit"), LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  if ! "${program[strata]}" --version > "$out/unpack.log" 2>&1; then
    log "the packed CLI does not start here: $(tail -3 "$out/unpack.log")"
    write_summary "build_failed" "packed programs do not start: $(tail -3 "$out/unpack.log")"
    exit 1
  fi
else
  if ! cmake -S . -B "$build" -DCMAKE_BUILD_TYPE="${STRATA_BUILD_TYPE:-Release}" -DSTRATA_ENABLE_CUDA=ON \
       -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCH=ON > "$out/configure.log" 2>&1; then
    log "configure failed, see configure.log"
    write_summary "build_failed" "cmake configure failed: $(tail -5 "$out/configure.log")"
    exit 1
  fi
  if ! grep -q "CUDA Toolkit: found" "$out/configure.log"; then
    log "CUDA Toolkit not found at configure time"
    write_summary "build_failed" "configure did not find the CUDA Toolkit: $(grep 'CUDA Toolkit' "$out/configure.log")"
    exit 1
  fi
  cmake --build "$build" -j "$jobs" > "$out/build.log" 2>&1 || build_rc=$?
  if [[ $build_rc -ne 0 ]]; then
    # Keep going with what the core check needs; the failure stays in the summary.
    log "full build failed (rc $build_rc, see build.log); building the core GPU targets only"
    if ! cmake --build "$build" -j "$jobs" --target strata_cli strata_device_tests strata_bench_device_copy \
         >> "$out/build.log" 2>&1; then
      write_summary "build_failed" "build failed: $(grep -m3 -E 'error' "$out/build.log")"
      exit 1
    fi
  fi
  for path in "${gpu_programs[@]}"; do program[$(basename "$path")]="$build/$path"; done
fi

# An engine run that hangs prints every thread's stack before its timeout
# (scripts/hangdump.c, packed by gpu-pack.sh or built here).
hangdump=""
if [[ -n "${STRATA_GPU_PACK:-}" ]]; then
  hangdump="$pack_dir/strata-gpu/lib/hangdump.so"
elif command -v cc > /dev/null; then
  cc -O1 -shared -fPIC -o "$build/hangdump.so" scripts/hangdump.c -lpthread 2>> "$out/build.log" && hangdump="$build/hangdump.so"
fi
# with_stacks SECONDS: the prefix that dumps the stacks 5 s before a timeout of SECONDS.
with_stacks() {
  if [[ -f "$hangdump" ]]; then echo "env LD_PRELOAD=$hangdump HANGDUMP_AFTER=$(($1 - 5))"; else echo env; fi
}

# 10. The peer (issue 50 §2 item 3; a measurement, not a check), only when
#     its wheels were carried: DeepSpeed ZeRO-3 with the optimizer and the
#     parameters offloaded to host memory, on a Llama-shaped model
#     (scripts/gpu-peer-deepspeed.py; STRATA_GPU_PEER_ARGS changes its shape),
#     in a venv over this machine's torch that scripts/gpu-peer-venv.sh makes
#     with no index. Its own timeouts (the install 120 s, the run
#     STRATA_GPU_PEER_TIMEOUT, default 300 s, DeepSpeed's JIT build of CPU
#     Adam included), so that it never costs the steps before it. Sets
#     peer_result, a JSON value for the summary.
peer_result='"not run: STRATA_GPU_PEER_WHEELS unset"'
run_peer() {
  local wheels="$STRATA_GPU_PEER_WHEELS" venv rc=0
  if ! compgen -G "$wheels/deepspeed-*.whl" > /dev/null; then
    peer_result="\"not run: no deepspeed wheel in $wheels (scripts/gpu-peer-wheels.sh makes the folder)\""
    log "peer (DeepSpeed): no deepspeed wheel in $wheels"
    return
  fi
  venv=$(mktemp -d)/peer-venv
  if ! timeout 120 scripts/gpu-peer-venv.sh python3 "$wheels" "$venv" > "$out/peer_install.log" 2>&1; then
    peer_result="\"install failed: $(tail -3 "$out/peer_install.log" | json_escape)\""
    log "peer (DeepSpeed): the offline install failed, see peer_install.log"
    return
  fi
  # shellcheck disable=SC2086 # STRATA_GPU_PEER_ARGS is a list of flags
  MAX_JOBS="$jobs" timeout "${STRATA_GPU_PEER_TIMEOUT:-300}" "$venv/bin/python" scripts/gpu-peer-deepspeed.py \
    ${STRATA_GPU_PEER_ARGS:-} --json "$out/peer_deepspeed.json" > "$out/peer_deepspeed.log" 2>&1 || rc=$?
  if [[ $rc -eq 0 && -s "$out/peer_deepspeed.json" ]]; then
    peer_result=$(cat "$out/peer_deepspeed.json")
    log "peer (DeepSpeed): $(python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["status"], r.get("reason", ""), *(["%s tokens/s, median step %s ms, %s params, %s model TFLOP/s" % (
      r["tokens_per_second"], r["step_ms"]["median"], r["model"]["parameters"], r["model_tflops"])] if "step_ms" in r else []))' \
      "$out/peer_deepspeed.json" 2>&1)"
  else
    peer_result="\"no result (rc $rc): $(tail -3 "$out/peer_deepspeed.log" | json_escape)\""
    log "peer (DeepSpeed): no result (rc $rc), see peer_deepspeed.log"
  fi
}

# strata.torch on the GPU (issue 50 §2): the pack's native module staged beside
# the working tree's python/strata, run by scripts/gpu-torch-check.py (the
# correctness matrix, then the headline run; STRATA_GPU_TORCH_PART=bench runs the
# penalty bench for the headline model instead). STRATA_GPU_TORCH_ARGS adds flags
# (e.g. the headline model's shape), STRATA_GPU_TORCH_TIMEOUT bounds it (420 s).
# Sets torch_result, a JSON value for the summary.
torch_result='"not run: the pack holds no strata.torch module (scripts/gpu-pack.sh packs the build'"'"'s own, or STRATA_GPU_PACK_PYTHON_MODULE)"'
torch_stage=""
stage_torch() {  # -> 0 with torch_stage set, or 1 with torch_result saying why not
  local module suffix
  module=$(ls "${pack_dir:-/nonexistent}"/strata-gpu/python/_native*.so 2> /dev/null | head -1)
  [[ -n "$module" ]] || return 1
  suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))' 2> /dev/null)
  if [[ "$(basename "$module")" != "_native$suffix" ]]; then
    torch_result="\"not run: the packed module is $(basename "$module"), this machine's python3 takes _native$suffix (build one for it: scripts/gpu-torch-module.sh)\""
    return 1
  fi
  torch_stage=$(mktemp -d)
  cp -r python/strata "$torch_stage/strata" && cp "$module" "$torch_stage/strata/" || return 1
  return 0
}
in_torch_stage() {  # the command with the staged package and the module's libraries first
  PYTHONPATH="$torch_stage${PYTHONPATH:+:$PYTHONPATH}" \
    LD_LIBRARY_PATH="$pack_dir/strata-gpu/python/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}
run_torch() {
  local rc=0
  stage_torch || { log "strata.torch: ${torch_result//\"/}"; return; }
  case "${STRATA_GPU_TORCH_PART:=all}" in
    all | matrix | headline | bench) ;;
    *)
      torch_result="\"STRATA_GPU_TORCH_PART '${STRATA_GPU_TORCH_PART//[^a-z0-9_-]/?}' is not all, matrix, headline or bench\""
      log "strata.torch: ${torch_result//\"/}"
      return
      ;;
  esac
  # shellcheck disable=SC2086 # STRATA_GPU_TORCH_ARGS is a list of flags
  in_torch_stage timeout "${STRATA_GPU_TORCH_TIMEOUT:-420}" python3 scripts/gpu-torch-check.py "$STRATA_GPU_TORCH_PART" \
    ${STRATA_GPU_TORCH_ARGS:-} --json "$out/torch_check.json" > "$out/torch_check.log" 2>&1 || rc=$?
  if [[ -s "$out/torch_check.json" ]]; then
    torch_result="{\"rc\": $rc, \"parts\": $(cat "$out/torch_check.json")}"
    log "strata.torch (rc $rc): $(python3 -c 'import json, sys
for part in json.load(open(sys.argv[1])):
    runs = ["%s: %s tokens/s, MFU %s" % (r["placement"], r["tokens_per_second"], r["mfu"]) for r in part.get("runs", [])]
    print(part["part"], part["status"], *(part.get("failures") or part.get("errors") or []), *runs, sep="; ")' \
      "$out/torch_check.json" 2>&1 | tr '\n' ' ')"
  else
    torch_result="\"no result (rc $rc): $(tail -3 "$out/torch_check.log" | json_escape)\""
    log "strata.torch: no result (rc $rc), see torch_check.log"
  fi
}

# 2. Is there a GPU? Ask the build's own probe (cudaGetDeviceCount).
"${program[strata]}" report --json > "$out/report.json" 2> "$out/report.stderr" || true
cuda_available=$(python3 -c 'import json,sys; print(str(json.load(open(sys.argv[1]))["devices"]["cuda"]["available"]).lower())' \
                   "$out/report.json" 2>/dev/null || echo unknown)
if [[ "$cuda_available" == "unknown" ]]; then
  grep -q '"available": true' <(sed -n '/"cuda"/,/}/p' "$out/report.json") && cuda_available=true || cuda_available=false
fi
if [[ "$cuda_available" != "true" ]]; then
  reason=$(sed -n '/"cuda"/,/}/p' "$out/report.json" | grep '"reason"' | sed 's/.*"reason": "\(.*\)",\{0,1\}$/\1/')
  log "no GPU: ${reason:-unknown reason}"
  # The suite still runs: its cuda cases must skip cleanly, its cpu cases pass.
  "${program[strata_device_tests]}" --gtest_output="json:$out/device_tests.json" > "$out/device_tests.log" 2>&1
  suite_rc=$?
  if [[ -n "${STRATA_GPU_PEER_WHEELS:-}" ]]; then
    peer_result='"skipped: no GPU"'
    compgen -G "$STRATA_GPU_PEER_WHEELS/deepspeed-*.whl" > /dev/null ||
      peer_result="\"skipped: no GPU, and no deepspeed wheel in $STRATA_GPU_PEER_WHEELS either\""
    log "peer (DeepSpeed): ${peer_result//\"/}"
  fi
  # strata.torch without a GPU: the packed module must still load (its libraries, this Python).
  if stage_torch; then
    if in_torch_stage python3 -c 'import strata, strata._native; print("strata", strata.__version__)' \
         > "$out/torch_import.log" 2>&1; then
      torch_result="\"skipped: no GPU; the packed module loads ($(tail -1 "$out/torch_import.log"))\""
    else
      torch_result="\"failed: the packed module does not load: $(tail -2 "$out/torch_import.log" | json_escape)\""
      suite_rc=1
    fi
  fi
  log "strata.torch: ${torch_result//\"/}"
  write_summary "no_gpu" "no GPU: ${reason:-unknown}" \
    "  \"build_rc\": $build_rc,
  \"device_suite_rc_without_gpu\": $suite_rc,
  \"torch\": $torch_result,
  \"peer\": $peer_result"
  [[ "${STRATA_GPU_REQUIRED:-0}" == "1" ]] && exit 3
  [[ $suite_rc -ne 0 ]] && exit 2
  exit 0
fi
log "GPU present: $(nvidia_smi_list | head -4 | tr '\n' ' ')"
if [[ "${STRATA_GPU_TORCH_ONLY:-0}" == "1" ]]; then
  run_torch
  [[ -n "${STRATA_GPU_PEER_WHEELS:-}" ]] && run_peer
  write_summary "torch_only" "strata.torch alone (STRATA_GPU_TORCH_ONLY=1)" "  \"torch\": $torch_result,
  \"peer\": $peer_result"
  [[ "$torch_result" == *'"status": "failed"'* || "$torch_result" != "{"* ]] && exit 2
  exit 0
fi
if [[ "${STRATA_GPU_PEER_ONLY:-0}" == "1" ]]; then
  if [[ -z "${STRATA_GPU_PEER_WHEELS:-}" ]]; then
    log "STRATA_GPU_PEER_ONLY=1 needs STRATA_GPU_PEER_WHEELS (the folder scripts/gpu-peer-wheels.sh makes)"
    write_summary "failed" "STRATA_GPU_PEER_ONLY=1 without STRATA_GPU_PEER_WHEELS"
    exit 2
  fi
  run_peer
  write_summary "peer_only" "the peer alone (STRATA_GPU_PEER_ONLY=1)" "  \"peer\": $peer_result"
  exit 0
fi

# 3. Every GPU test, by name (tests/core/CMakeLists.txt says why not by
#    label), each program run directly with a gtest filter so that packed
#    programs need no ctest files: the device suite's cuda cases, NCCL on one
#    GPU, the CUDA model ops, the device Adam kernel (fp32/bf16 and 8-bit
#    moments). A test skipped because the GPU is not usable fails the check;
#    a few skip by design on cuda (a cpu-device property, the no-GPU error
#    path) and are counted apart.
gtest_counts() {  # JSON report, log -> "run failed skipped_without_gpu skipped_by_design"
  python3 -c 'import json, re, sys
report = json.load(open(sys.argv[1]))
cases = [case for suite in report.get("testsuites", []) for case in suite.get("testsuite", [])]
failed = sum(1 for case in cases if case.get("failures"))
# The skip messages are in the log only: "file:line: Skipped" then the message.
log = open(sys.argv[2], errors="replace").read()
messages = re.findall(r": Skipped\n(.*)\n", log)
no_gpu = re.compile(r"not available|no usable GPU|built without CUDA|0 devices")
without_gpu = sum(1 for m in messages if no_gpu.search(m))
print(len(cases), failed, without_gpu, len(messages) - without_gpu)' "$1" "$2" 2> /dev/null || echo "0 0 0 0"
}
gpu_tests_rc=0
gpu_tests_run=0; gpu_tests_failed=0; gpu_tests_skipped=0; gpu_tests_skipped_by_design=0
for entry in "device_tests_cuda strata_device_tests */cuda" "comm_tests_nccl strata_comm_tests NcclComm.*" \
             "model_tests_cuda strata_model_tests CudaOps.*" "device_adam_tests strata_device_adam_tests DeviceAdamGpu.*"; do
  read -r tag name filter <<< "$entry"
  rc=0
  timeout 300 "${program[$name]}" --gtest_filter="$filter" --gtest_output="json:$out/$tag.json" > "$out/$tag.log" 2>&1 || rc=$?
  read -r run failed skipped by_design <<< "$(gtest_counts "$out/$tag.json" "$out/$tag.log")"
  log "$name --gtest_filter='$filter': $run run, $failed failed, $skipped skipped without a usable GPU, $by_design skipped by design (rc $rc)"
  grep -E '^\[  (FAILED|SKIPPED) \] .* \([0-9]+ ms\)$' "$out/$tag.log" | head -20 | tee -a "$out/gpu-check.log"
  [[ $rc -ne 0 || $run -eq 0 ]] && gpu_tests_rc=1
  gpu_tests_run=$((gpu_tests_run + run)); gpu_tests_failed=$((gpu_tests_failed + failed))
  gpu_tests_skipped=$((gpu_tests_skipped + skipped)); gpu_tests_skipped_by_design=$((gpu_tests_skipped_by_design + by_design))
done
gpu_tests_passed=$((gpu_tests_run - gpu_tests_failed - gpu_tests_skipped - gpu_tests_skipped_by_design))
log "GPU tests: $gpu_tests_run run, $gpu_tests_passed passed, $gpu_tests_failed failed, $gpu_tests_skipped skipped without a usable GPU, $gpu_tests_skipped_by_design skipped by design"

# 4. Device copy benchmarks, pinned vs pageable, on cuda (and on the cpu
#    device for comparison).
reps=5
[[ "${STRATA_GPU_CHECK_QUICK:-0}" == "1" ]] && reps=2
bench_rc=0
for backend in cuda cpu; do
  timeout 120 "${program[strata_bench_device_copy]}" --device=$backend --benchmark_repetitions=$reps \
    --benchmark_report_aggregates_only=true --benchmark_out="$out/bench_device_copy_$backend.json" \
    --benchmark_out_format=json > "$out/bench_device_copy_$backend.log" 2>&1 || bench_rc=$?
done
log "device copy benchmarks rc $bench_rc; medians:"
grep -E '_median' "$out/bench_device_copy_cuda.log" | tee -a "$out/gpu-check.log"

# 4b. The device Adam kernel (fp32, bf16 and 8-bit moments, 64M parameters)
#     against its own bytes at the device-to-device copy rate.
timeout 180 "${program[strata_device_adam_bench]}" --benchmark_repetitions=$reps \
  --benchmark_report_aggregates_only=true --benchmark_out="$out/bench_device_adam.json" \
  --benchmark_out_format=json > "$out/bench_device_adam.log" 2>&1 || bench_rc=$?
log "device Adam benchmark rc $bench_rc; ceiling and medians:"
grep -E '^device:|_median' "$out/bench_device_adam.log" | tee -a "$out/gpu-check.log"

# 5. The engine on the GPU (issue 11): stage 0 and stage 3 with the optimizer
#    on the device (fused Adam kernel), and stage 3 with the optimizer and
#    the parameters offloaded to host memory (CPU Adam), and ZeRO-Infinity:
#    stage 3 with both on NVMe. The device kernel is bit-identical to CPU
#    Adam and every placement gives the same losses, so the four loss
#    sequences must be equal.
engine_rc=0
engine_runs=()
engine_nvme=$(mktemp -d)
for placement in "--stage 0 --offload-optimizer none" "--stage 3 --offload-optimizer none" \
                 "--stage 3 --offload-optimizer cpu --offload-param cpu" \
                 "--stage 3 --offload-optimizer nvme --offload-param nvme --nvme-path $engine_nvme"; do
  tag=$(echo "${placement% --nvme-path *}" | tr -d ' -')
  engine_runs+=("$out/engine_$tag.jsonl")
  timeout 60 $(with_stacks 60) "${program[strata]}" train --device cuda --preset tiny --steps 20 --eval-every 0 --quiet $placement \
    --json-log "$out/engine_$tag.jsonl" > "$out/engine_$tag.log" 2>&1 || engine_rc=$?
done
rm -rf "$engine_nvme"
log "engine on cuda rc $engine_rc; first/last losses:"
for f in "${engine_runs[@]}"; do
  [[ -f "$f" ]] && echo "$(basename "$f"): $(head -1 "$f" | grep -o '"loss":[^,]*') $(tail -1 "$f" | grep -o '"loss":[^,]*')" \
    | tee -a "$out/gpu-check.log"
done
engine_losses=$(python3 -c 'import json, sys
runs = []
for path in sys.argv[1:]:
    try:
        runs.append([json.loads(line)["loss"] for line in open(path) if line.strip()])
    except (OSError, ValueError, KeyError) as error:
        print("unreadable", path, error); sys.exit(1)
if not runs or not runs[0] or any(len(run) != len(runs[0]) for run in runs):
    print("different step counts", [len(run) for run in runs]); sys.exit(1)
for step, values in enumerate(zip(*runs), start=1):
    if any(value != values[0] for value in values):
        print("first difference at step", step, list(values)); sys.exit(1)
print("identical over", len(runs[0]), "steps")' "${engine_runs[@]}" 2>&1)
engine_losses_rc=$?
log "engine losses across the three placements: $engine_losses"
[[ $engine_losses_rc -ne 0 ]] && engine_rc=1

# 6. What offload costs on this GPU (a measurement, not a pass/fail check):
#    the `small` preset at stage 2 with the optimizer on the device, in host
#    memory and on NVMe (a folder on this machine's disk), at stage 3 with
#    parameters in host memory, and the NVMe rows again with 8-bit moments
#    (strata.optimizer_state_dtype int8, issue 24); median step time of
#    steps 6-15, the exposed optimizer wait and the NVMe bytes per step.
offload_rows=()
nvme_dir=$(mktemp -d)
printf '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "%s"}},\n "strata": {"optimizer_state_dtype": "int8"}}\n' \
  "$nvme_dir" > "$out/offload_int8_nvme.json"
for placement in "--stage 2 --offload-optimizer none" "--stage 2 --offload-optimizer cpu" \
                 "--stage 2 --offload-optimizer nvme" "--stage 3 --offload-optimizer cpu --offload-param cpu" \
                 "--config $out/offload_int8_nvme.json" "--config $out/offload_int8_nvme.json --stage 3 --offload-param cpu"; do
  tag=$(echo "$placement" | sed "s|$out/||" | tr -d ' -' | tr -c 'a-zA-Z0-9_\n' '_')
  timeout 60 $(with_stacks 60) "${program[strata]}" train --device cuda --preset small --steps 15 --eval-every 0 --quiet $placement \
    --nvme-path "$nvme_dir" --json-log "$out/offload_$tag.jsonl" > "$out/offload_$tag.log" 2>&1
  row_rc=$?
  row=$(python3 -c 'import json, statistics, sys
steps = [json.loads(line) for line in open(sys.argv[1]) if line.strip()][5:]
median = lambda key: statistics.median(key(s) for s in steps)
print("median step %.1f ms, optimizer exposed %.1f ms, NVMe read + write %.1f MB per step, %d steps" % (
      median(lambda s: s["step_ms"]), median(lambda s: s["exposed_ms"]["optimizer"]),
      median(lambda s: s["bytes"]["nvme_read"] + s["bytes"]["nvme_write"]) / 1e6, len(steps)))' \
      "$out/offload_$tag.jsonl" 2> /dev/null || echo "no result (rc $row_rc): $(tail -2 "$out/offload_$tag.log" | tr '\n' ' ')")
  log "offload cost, small preset, ${placement//$out\//}: $row"
  offload_rows+=("${placement//$out\//}: $row")
done
rm -rf "$nvme_dir"

# 7. The GPU machine's own CPU (a measurement): its model and ISA, and the
#    CPU Adam step (fp32 and 8-bit moments, 1 thread and every core) against
#    the streaming ceiling of its bytes; a second kind of core beside the
#    dev VM's (docs/cpu_adam.md asks for an Intel measurement of the 8-bit
#    encode).
host_cpu=$(python3 -c 'import json, sys; cpu = json.load(open(sys.argv[1]))["cpu"]
print(cpu["model"], "|", cpu["logical_cores"], "logical cores |", " ".join(k for k, v in cpu["isa"].items() if v))' \
  "$out/report.json" 2> /dev/null || echo unknown)
log "host CPU: $host_cpu"
cpu_adam_rows=()
for moments in fp32 int8; do
  for threads in 1 0; do
    timeout 120 "${program[strata]}" bench cpu-adam --moment-dtype $moments --params 64M --threads $threads --reps 10 \
      --json > "$out/cpu_adam_${moments}_t$threads.json" 2> "$out/cpu_adam_${moments}_t$threads.log"
    row=$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("%d threads: %.3f Gparam/s, %.1f GB/s, ratio to the streaming ceiling %.3f" % (r["threads"], r["params_per_second"] / 1e9,
      r["bytes_per_second"] / 1e9, r["ratio"]))' "$out/cpu_adam_${moments}_t$threads.json" 2> /dev/null || echo "no result")
    log "cpu-adam $moments moments, 64M, $row"
    cpu_adam_rows+=("$moments $row")
  done
done

# 8. Early, exact updates on the GPU (issue 24 §1, a measurement): the CPU
#    optimizer's step under the backward, against the ideal exposed time
#    max(0, optimizer - (forward + backward)), three variants in ABBA order
#    (bench/engine/early_updates.py). --clip 0, because the step after a
#    clipped one does not start early (with the default clip every step of
#    this short run clips). Two optimizer threads: on the H200 machine's
#    host (2026-12-04) `small`'s forward took 12.7 ms and its backward 8.6,
#    and CPU Adam ran ~0.9 Gparam/s per thread, so 25.9M parameters take
#    ~15 ms on two, between the forward and the forward + backward (the
#    issue's case); the line prints whether it was.
early_rows=()
for threads in 2; do
  timeout 120 $(with_stacks 120) python3 bench/engine/early_updates.py "${program[strata]}" --rounds 2 --steps 12 \
    --json "$out/early_updates_t$threads.json" -- --device cuda --preset small --stage 2 --offload-optimizer cpu \
    --optimizer-threads $threads --clip 0 > "$out/early_updates_t$threads.log" 2>&1
  row="optimizer threads $threads: $(grep -E '^ceiling:' "$out/early_updates_t$threads.log" || echo 'no result (see the log)')"
  log "early updates, small, stage 2, host optimizer, $row"
  early_rows+=("$row")
done

# 9. The step-time model on the GPU (issue 24: "strata plan predicts the
#    rows within 20 %"; a measurement): a profile calibrated here on cuda,
#    then `strata bench offload` on cuda with four placements, the 8-bit
#    NVMe row, and that row with early updates and the NVMe pipelines (issue
#    24 §2's target row), each beside its prediction from that profile.
plan_rows=()
plan_dir=$(mktemp -d)
timeout 120 "${program[strata]}" report --calibrate --calibrate-device cuda --calibrate-model small --calibrate-batch 8 \
  --calibrate-seq 64 --calibrate-dtype fp32 --path "$plan_dir" --out "$out/profile_cuda.json" > "$out/calibrate_cuda.log" 2>&1
log "calibrated on cuda (rc $?): $(grep -E '^calibrate: compute' "$out/calibrate_cuda.log" || tail -1 "$out/calibrate_cuda.log")"
cat > "$out/plan_rows.json" << 'ROWS'
{"rows": [{"stage": 2, "dtype": "fp32"}, {"stage": 2, "offload_optimizer": "cpu", "dtype": "fp32"},
          {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "dtype": "fp32"},
          {"stage": 2, "offload_optimizer": "nvme", "dtype": "fp32"},
          {"stage": 2, "offload_optimizer": "nvme", "dtype": "fp32", "optimizer_state_dtype": "int8"},
          {"stage": 2, "offload_optimizer": "nvme", "dtype": "fp32", "optimizer_state_dtype": "int8",
           "speculative_optimizer": "on", "pipeline_read": true, "pipeline_write": true}]}
ROWS
if [[ -f "$out/profile_cuda.json" ]]; then
  timeout 150 $(with_stacks 150) "${program[strata]}" bench offload --device cuda --preset small --batch 8 --seq 64 \
    --configs "$out/plan_rows.json" --steps 5 --warmup 2 --repeats 2 --nvme-path "$plan_dir" \
    --profile "$out/profile_cuda.json" --json "$out/bench_offload_cuda.json" > "$out/bench_offload_cuda.log" 2>&1
  while IFS= read -r line; do
    log "plan vs measured: $line"
    plan_rows+=("$line")
  done < <(python3 -c 'import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    p = r.get("predicted")
    print("%s: measured %.1f ms, predicted %s" % (r["label"], r["step_ms"]["median"],
          "%.1f ms (error %+.0f %%)" % (p["step_ms"], 100 * p["error"]) if p else "none (" + r["status"] + ")"))' \
    "$out/bench_offload_cuda.json" 2> /dev/null || echo "no result: $(tail -2 "$out/bench_offload_cuda.log" | tr '\n' ' ')")
fi
rm -rf "$plan_dir"

[[ -n "${STRATA_GPU_PEER_WHEELS:-}" ]] && run_peer

status=ok
[[ $gpu_tests_rc -ne 0 || $gpu_tests_skipped -ne 0 || $bench_rc -ne 0 || $engine_rc -ne 0 ]] && status=failed
# "H2D/pinned/4194304/real_time_median ... bytes_per_second=24.1G/s pinned" -> "H2D/pinned/4194304": "24.1G/s pinned"
medians=$(grep -E '_median' "$out/bench_device_copy_cuda.log" | awk '{
  value = ""; for (i = 2; i <= NF; ++i) if ($i ~ /^bytes_per_second=/) { value = substr($i, 18); for (j = i + 1; j <= NF; ++j) value = value " " $j }
  name = $1; sub(/\/real_time_median$/, "", name)
  printf "%s    \"%s\": \"%s\"", (NR > 1 ? ",\n" : ""), name, value }')
write_summary "$status" "GPU tests: $gpu_tests_run run, $gpu_tests_failed failed, $gpu_tests_skipped skipped without a usable GPU" \
  "  \"build_rc\": $build_rc,
  \"bench_rc\": $bench_rc,
  \"engine_rc\": $engine_rc,
  \"engine_losses\": \"$(printf '%s' "$engine_losses" | json_escape)\",
  \"host_cpu\": \"$(printf '%s' "$host_cpu" | json_escape)\",
  \"cpu_adam_rows\": \"$(printf '%s; ' "${cpu_adam_rows[@]}" | json_escape)\",
  \"offload_rows\": \"$(printf '%s; ' "${offload_rows[@]}" | json_escape)\",
  \"early_update_rows\": \"$(printf '%s; ' "${early_rows[@]}" | json_escape)\",
  \"plan_rows\": \"$(printf '%s; ' "${plan_rows[@]}" | json_escape)\",
  \"peer\": $peer_result,
  \"gpu_tests\": {\"rc\": $gpu_tests_rc, \"run\": $gpu_tests_run, \"passed\": $gpu_tests_passed, \"failed\": $gpu_tests_failed,
                \"skipped_without_gpu\": $gpu_tests_skipped, \"skipped_by_design\": $gpu_tests_skipped_by_design},
  \"cuda_copy_medians\": {
$medians
  }"
[[ "$status" == ok ]] || exit 2
exit 0
