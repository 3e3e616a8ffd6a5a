#!/usr/bin/env bash
# Installs dependencies (PyTorch included), builds Strata, and runs every test:
#   1. the full suite (ctest) on the release build; the PyTorch comparisons
#      are required here: without torch they fail instead of skipping,
#   1b. the Python package's pytest suite (python/test.sh; torch, transformers
#       and mpirun required), on Debian's torch 1.13 and on torch 2.x from PyPI,
#   2. the core, config, nvme, cpu_adam and offload (the engine) suites again
#      under ASan + UBSan (the offload suite's mpirun tests excepted),
#   3. the concurrency-heavy suites (core, comm, nvme, offload: the engine) under TSan,
#   4. every libFuzzer target of tests/fuzz for STRATA_FUZZ_SECONDS (default
#      20) each, seeded, failing on a crash, a leak, UB or a broken property.
# GPU tests skip cleanly on machines without a GPU.
# Environment: STRATA_JOBS (parallel jobs, default nproc),
#   STRATA_SKIP_SANITIZE=1 skips 2 and 3, STRATA_TSAN=0 skips 3 only,
#   STRATA_TSAN_LABELS (ctest label regex of 3, default core|comm|nvme|offload),
#   STRATA_FUZZ_SECONDS=0 skips 4.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --with-torch
jobs="${STRATA_JOBS:-$(nproc)}"
# A comparison that cannot import torch is an error in CI, not a skip.
export STRATA_REQUIRE_TORCH=1

started=$SECONDS
phase() { echo "== test-all: $1 (at $((SECONDS - started)) s)"; }

# Debug information: line tables only (-g1), enough for the stack traces of a
# failing test or a sanitizer report; full -g made every compile 20-40 % slower
# (measured on apps/cmd_plan.cpp: -O2 -g 39 s, -O2 -g1 24 s), and the builds
# are most of this script's time on 2 cores (docs/performance.md, "CI time").
phase "release build"
STRATA_BUILD_DIR=build scripts/build.sh -DSTRATA_REQUIRE_TORCH=ON "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
phase "release ctest"
ctest --test-dir build -j "$jobs" --output-on-failure

# The Python package (python/, docs/python.md): its native module is added to
# the release build (only the module compiles), then pytest runs in a venv of
# /usr/bin/python3 --system-site-packages; a missing torch fails.
phase "python package (build + pytest)"
STRATA_PYTHON_BUILD_DIR=build python/test.sh
# The same suite on the current torch 2.x and transformers from PyPI (a venv of
# its own, issue 23): strata.torch must work on both.
phase "python package on torch 2.x (PyPI venv + pytest)"
STRATA_PYTHON_ENV=torch2 STRATA_PYTHON_BUILD_DIR=build python/test.sh

if [[ "${STRATA_SKIP_SANITIZE:-0}" != "1" ]]; then
  # The sanitizer builds skip CUDA, benchmarks and the test folders whose labels
  # they do not run (STRATA_TEST_DIRS) to keep CI quick.
  phase "ASan+UBSan build"
  STRATA_BUILD_DIR=build-asan STRATA_BUILD_TYPE=Debug scripts/build.sh "-DCMAKE_CXX_FLAGS_DEBUG=-g1" \
    -DSTRATA_SANITIZE=address -DSTRATA_ENABLE_CUDA=OFF -DSTRATA_BUILD_BENCH=OFF -DSTRATA_REQUIRE_TORCH=ON \
    "-DSTRATA_TEST_DIRS=core;config;nvme;cpu_adam;offload;fuzz"
  phase "ASan+UBSan ctest"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan -j "$jobs" --output-on-failure -L "core|config|nvme|cpu_adam|offload" \
          -E "offload_mpi_(parity|resume|step_retry|config_batch)"

  if [[ "${STRATA_TSAN:-1}" != "0" ]]; then
    # -O1: TSan at -O0 runs the thread-heavy tests several times slower; at -O2
    # they ran 2.6 % faster than at -O1 (466 vs 478 s) but a source compiled
    # 35-40 % slower (docs/performance.md, "Build flags and unity batches").
    # oneTBB's scheduler lives in an uninstrumented libtbb.so, so TSan would see
    # no ordering between a parallel_for's caller and its workers: under TSan the
    # model's and cpu_adam's loops run inline (STRATA_TSAN_SERIAL_LOOPS) and
    # OpenBLAS gets one thread, so the engine's own threads (optimizer, shard
    # reader, copy streams, comm queues, I/O completions) are what TSan checks.
    # cpu_adam's own suite still is not run here (its tests are about the tiles).
    # One core test races on purpose (a host poll of memory the copy engine
    # writes, as a GPU's DMA would; see its comment), so it runs in the other two
    # jobs only; the offload suite's mpirun scripts and the tests that run the
    # CLI binary (a 300-step training, kill -9 saves) are left to them too.
    # So are the runs that only repeat the same threads on more data: the
    # world-2 and world-4 rows of the parity matrices and the fp16/bf16 resume
    # rows (world 1 and fp32 run here; the release and ASan jobs run them all) and the
    # 300-step learning check of the tiny preset (minutes under TSan, its
    # threads are those of every other engine test).
    phase "TSan build"
    STRATA_BUILD_DIR=build-tsan scripts/build.sh "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
      -DSTRATA_SANITIZE=thread -DSTRATA_ENABLE_CUDA=OFF -DSTRATA_BUILD_BENCH=OFF -DSTRATA_REQUIRE_TORCH=ON \
      "-DSTRATA_TEST_DIRS=core;comm;nvme;offload;fuzz"
    phase "TSan ctest"
    # history_size=7: without the earlier access's stack a third-party race
    # cannot be matched by scripts/tsan.supp (OpenMPI and liburing only, never our code).
    OPENBLAS_NUM_THREADS=1 TSAN_OPTIONS="second_deadlock_stack=1 history_size=7 suppressions=$PWD/scripts/tsan.supp" \
      ctest --test-dir build-tsan -j "$jobs" --output-on-failure -L "${STRATA_TSAN_LABELS:-core|comm|nvme|offload}" \
            -E "DeviceTest.CopyOnOneStreamOverlapsComputeOnAnother/cpu|offload_mpi_|TrainFixture|CheckpointCli|ParityMatrix.*world[24]|Int8Parity.*world2|ResumeParity.*/(fp16|bf16)|Stage0Baseline.TinyPresetBeatsUnigramBaseline"
  fi
fi
fuzz_seconds="${STRATA_FUZZ_SECONDS:-20}"
if [[ "$fuzz_seconds" != "0" ]]; then
  for target in $(scripts/fuzz.sh --list | sed 's/^fuzz targets: //'); do
    phase "fuzz $target (${fuzz_seconds} s)"
    scripts/fuzz.sh "$target" "$fuzz_seconds"
  done
fi
phase "all green"
