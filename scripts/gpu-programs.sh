# The programs the GPU check runs, as paths in a build folder. Sourced by
# scripts/gpu-pack.sh (what it packs) and scripts/gpu-check.sh (what it runs,
# from a build or from a pack, where they sit by their file names).
gpu_programs=(tests/core/strata_device_tests tests/comm/strata_comm_tests tests/model/strata_model_tests
              tests/offload/strata_device_adam_tests apps/strata bench/core/strata_bench_device_copy
              bench/offload/strata_device_adam_bench)
