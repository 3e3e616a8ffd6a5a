# Bad input to `strata bench cpu-adam`, `strata bench offload` and `strata plan` (uses strata_flag_error_test).
set(bad_plan ${CMAKE_CURRENT_BINARY_DIR}/bad-plan)
set(consumer_profile ${PROJECT_SOURCE_DIR}/examples/profiles/consumer-24gb.json)
set(offload_rows ${CMAKE_CURRENT_SOURCE_DIR}/data/offload_rows.json)

# bench cpu-adam --params: every buffer's byte count fits in 64 bits (2^63 segfaulted, 2^62 blamed the param copy).
strata_flag_error_test(cpu_adam_params_2p63 "--params 9223372036854775808 is more than 4611686018427387888, the most"
  bench cpu-adam --params 9223372036854775808 --reps 1)
strata_flag_error_test(cpu_adam_params_max_u64 "--params 18446744073709551615 is more than 4611686018427387888"
  bench cpu-adam --params 18446744073709551615 --reps 1)
strata_flag_error_test(cpu_adam_params_2p62 "--params 4611686018427387904 is more than .*e.g. 64M"
  bench cpu-adam --params 4611686018427387904 --reps 1)
# bench cpu-adam moment flags: the values it accepts, the flags that clash.
strata_flag_error_test(cpu_adam_moment_dtype_int4 "--moment-dtype 'int4' is not a moment dtype; use fp32, bf16 or int8"
  bench cpu-adam --moment-dtype int4 --params 1M --reps 1)
strata_flag_error_test(cpu_adam_grad_dtype_fp64 "--grad-dtype 'fp64' is not a gradient dtype; use fp32, bf16 or fp16"
  bench cpu-adam --grad-dtype fp64 --params 1M --reps 1)
strata_flag_error_test(cpu_adam_int8_adagrad
  "--moment-dtype int8 with --kernel adagrad: 8-bit moments are implemented for --kernel adam and adamw only"
  bench cpu-adam --kernel adagrad --moment-dtype int8 --params 1M --reps 1)
strata_flag_error_test(cpu_adam_moment_block_without_int8
  "--moment-block 512 applies to --moment-dtype int8 only.*add --moment-dtype int8"
  bench cpu-adam --moment-block 512 --params 1M --reps 1)

# plan --params past what the estimator represents, and worlds past 2^24 (int overflow before).
strata_flag_error_test(plan_params_2p63 "--params .*: the byte counts of this model exceed 2\\^64 bytes"
  plan --params 9223372036854775808 --profile ${consumer_profile})
strata_flag_error_test(plan_world_overflow
  "--nodes 1048576 x --gpus-per-node 2048 = 2147483648 ranks is more than the 16777216 Strata models"
  plan --params 13B --nodes 1048576 --gpus-per-node 2048 --profile ${consumer_profile})
strata_flag_error_test(plan_world_wraps_to_zero "--nodes 1048576 x --gpus-per-node 4096 = 4294967296 ranks"
  plan --params 13B --nodes 1048576 --gpus-per-node 4096 --profile ${consumer_profile})
# The largest world modeled, with --model: each rank's plan and the fit hints
# are computed per run of ranks with the same pieces, not per rank (plan took
# minutes here, estimate 46 s); the hint names the caps, not a --ranks limit;
# tokens/s past 12 digits keeps its column (4 significant digits).
add_test(NAME apps.plan_model_largest_world COMMAND strata_cli plan --model small --nodes 4096 --gpus-per-node 4096
         --profile ${PROJECT_SOURCE_DIR}/examples/profiles/dgx-h100.json)
set_tests_properties(apps.plan_model_largest_world PROPERTIES LABELS apps TIMEOUT 60
  PASS_REGULAR_EXPRESSION "on 16777216 rank.* [|] +[0-9.]+ +[0-9.]+e[+]1[0-9] .*to fit: no knob fits it: device needs")
add_test(NAME apps.estimate_model_largest_world COMMAND strata_cli estimate --model small --nodes 4096
         --gpus-per-node 4096)
set_tests_properties(apps.estimate_model_largest_world PROPERTIES LABELS apps TIMEOUT 60
  PASS_REGULAR_EXPRESSION "engine plan per rank: small: .* on 16777216 rank.*\n +3 +nvme +nvme ")

# --profile, --configs and --bench go through the strict JSON reader (strata/core/json_file.h).
file(WRITE ${bad_plan}/profile_bad_json.json "{\n  \"name\": \"x\",\n  compute_gflops: 1\n}\n")
file(WRITE ${bad_plan}/profile_duplicate.json [=[{"name": "dup", "gpus_per_node": 1, "device_memory_bytes": 24e9,
 "host_memory_bytes": 128e9, "nvme_bytes": 2e12, "compute_gflops": 66000, "compute_gflops": 1, "h2d_gb_per_s": 25,
 "d2h_gb_per_s": 25, "collective_bus_gb_per_s": 800, "nvme_read_gb_per_s": 7, "nvme_write_gb_per_s": 5,
 "cpu_adam_params_per_s": {"fp32": 2e9, "bf16": 2e9}, "device_adam_params_per_s": 25e9}]=])
set(profile_rest [=["host_memory_bytes": 128e9, "nvme_bytes": 2e12, "h2d_gb_per_s": 25, "d2h_gb_per_s": 25,
 "collective_bus_gb_per_s": 800, "nvme_read_gb_per_s": 7, "nvme_write_gb_per_s": 5,
 "cpu_adam_params_per_s": {"fp32": 2e9, "bf16": 2e9}, "device_adam_params_per_s": 25e9}]=])
file(WRITE ${bad_plan}/profile_escape_name.json
  "{\"name\": \"evil\\u001b[31mRED\\u0007\\nfake\", \"device_memory_bytes\": 24e9, \"compute_gflops\": 66000, ${profile_rest}")
file(WRITE ${bad_plan}/profile_fractional_bytes.json
  "{\"name\": \"half\", \"device_memory_bytes\": 0.5, \"compute_gflops\": 66000, ${profile_rest}")
file(WRITE ${bad_plan}/profile_tiny_compute.json
  "{\"name\": \"slow\", \"device_memory_bytes\": 24e9, \"compute_gflops\": 1e-300, ${profile_rest}")
file(WRITE ${bad_plan}/rows_duplicate.json [=[{"rows": [{"stage": 3, "stage": 1}]}]=])
file(WRITE ${bad_plan}/rows_one.json [=[{"rows": [{"stage": 3, "offload_optimizer": "cpu"}]}]=])
file(WRITE ${bad_plan}/rows_tiny_ratio.json [=[{"rows": [{"stage": 3, "offload_optimizer": "cpu", "ratio": 1e-300}]}]=])
file(WRITE ${bad_plan}/bench_no_median.json
  [=[{"bench": "offload", "rows": [{"label": "s3 opt=cpu param=none bf16", "status": "ok"}]}]=])

strata_flag_error_test(plan_profile_directory
  "--profile: hardware profile '.*' is not a regular file \\(a directory\\); give a hardware profile JSON"
  plan --params 13B --profile ${CMAKE_CURRENT_SOURCE_DIR})
add_test(NAME apps.plan_profile_fifo
  COMMAND sh -c "d=$(mktemp -d) && mkfifo $d/fifo && $<TARGET_FILE:strata_cli> plan --params 13B --profile $d/fifo; rm -rf $d")
set_tests_properties(apps.plan_profile_fifo PROPERTIES LABELS apps TIMEOUT 30
  PASS_REGULAR_EXPRESSION "--profile: hardware profile '.*' is not a regular file \\(a FIFO\\)")
add_test(NAME apps.plan_profile_too_large
  COMMAND sh -c "f=$(mktemp) && head -c 5000000 /dev/zero | tr '\\0' ' ' > $f && $<TARGET_FILE:strata_cli> plan --params 13B --profile $f; rm -f $f")
set_tests_properties(apps.plan_profile_too_large PROPERTIES LABELS apps TIMEOUT 30
  PASS_REGULAR_EXPRESSION "--profile: hardware profile '.*' is larger than 4194304 bytes")
strata_flag_error_test(plan_profile_bad_json
  "--profile: hardware profile '.*profile_bad_json.json': not valid JSON: parse error at line 3, column 3.*no trailing commas"
  plan --params 13B --profile ${bad_plan}/profile_bad_json.json)
strata_flag_error_test(plan_profile_duplicate_key "--profile: hardware profile '.*profile_duplicate.json': compute_gflops: duplicate key"
  plan --params 13B --profile ${bad_plan}/profile_duplicate.json)
strata_flag_error_test(plan_profile_name_escaped "profile evil\\\\x1b\\[31mRED\\\\x07\\\\x0afake"
  plan --params 13B --profile ${bad_plan}/profile_escape_name.json)
strata_flag_error_test(plan_profile_fractional_bytes
  "--profile: .*profile_fractional_bytes.json: \"device_memory_bytes\" 0.5 is not a whole number of bytes"
  plan --params 13B --profile ${bad_plan}/profile_fractional_bytes.json)
strata_flag_error_test(plan_profile_tiny_compute
  "\"compute_gflops\" is 1e-300 GFLOP/s; a real machine's is from 0.001 to 1e\\+09 GFLOP/s"
  plan --params 13B --profile ${bad_plan}/profile_tiny_compute.json)
strata_flag_error_test(plan_configs_duplicate_key
  "--configs: row file '.*rows_duplicate.json': rows\\[0\\].stage: duplicate key"
  plan --params 13B --profile ${consumer_profile} --configs ${bad_plan}/rows_duplicate.json)
strata_flag_error_test(plan_bench_directory "--bench: bench result '.*' is not a regular file \\(a directory\\)"
  plan --params 13B --profile ${consumer_profile} --bench ${CMAKE_CURRENT_SOURCE_DIR})
strata_flag_error_test(plan_bench_row_without_median "rows\\[0\\].step_ms.median must be a positive number"
  plan --params 13B --profile ${consumer_profile} --configs ${bad_plan}/rows_one.json
  --bench ${bad_plan}/bench_no_median.json)
# A row file's tiny ratio is labelled as given, not as r=0.00.
strata_flag_error_test(plan_configs_tiny_ratio_label "s3 opt=cpu param=none r=1e-300 bf16"
  plan --params 13B --profile ${consumer_profile} --configs ${bad_plan}/rows_tiny_ratio.json)

# Flags that --configs would silently ignore, and lists that would repeat every row.
strata_flag_error_test(plan_configs_with_optimizer_states "--optimizer-states with --configs: each row of the file"
  plan --params 13B --profile ${consumer_profile} --configs ${bad_plan}/rows_one.json --optimizer-states int8)
strata_flag_error_test(plan_configs_with_dtype_list "--dtype bf16,fp32 with --configs: each row of the file has one dtype"
  plan --params 13B --profile ${consumer_profile} --configs ${bad_plan}/rows_one.json --dtype bf16,fp32)
strata_flag_error_test(plan_optimizer_states_twice "--optimizer-states lists int8 twice"
  plan --params 13B --profile ${consumer_profile} --optimizer-states int8,int8)
strata_flag_error_test(plan_dtype_twice "--dtype lists bf16 twice"
  plan --params 13B --profile ${consumer_profile} --dtype bf16,bf16)
strata_flag_error_test(bench_offload_configs_with_optimizer_states "--optimizer-states with --configs"
  bench offload --configs ${offload_rows} --optimizer-states int8 --steps 1 --warmup 0 --repeats 1)
strata_flag_error_test(bench_offload_dtype_twice "--dtype lists bf16 twice"
  bench offload --dtype bf16,bf16 --steps 1 --warmup 0 --repeats 1)
add_test(NAME apps.bench_offload_csv_fifo
  COMMAND sh -c "d=$(mktemp -d) && mkfifo $d/fifo && $<TARGET_FILE:strata_cli> bench offload --configs ${offload_rows} --csv $d/fifo --steps 1 --warmup 0 --repeats 1; rm -rf $d")
set_tests_properties(apps.bench_offload_csv_fifo PROPERTIES LABELS apps TIMEOUT 60
  PASS_REGULAR_EXPRESSION "--csv '.*' is not a regular file \\(a FIFO\\)")

# The model-shape flags take the model's own ranges everywhere (model::GptLimits,
# apps/model_shape_flags.h); plan, estimate and bench offload advertised 1..100000
# blocks and vocabularies below the byte tokenizer's 256.
strata_flag_error_test(plan_model_layers_range "--layers: Value 2000 not in range 1 to 1024"
  plan --model small --layers 2000 --profile ${consumer_profile})
strata_flag_error_test(estimate_model_heads_range "--heads: Value 70000 not in range 1 to 65536"
  estimate --model small --heads 70000)
strata_flag_error_test(bench_offload_vocab_range "--vocab: Value 100 not in range 256 to 16777216"
  bench offload --vocab 100)
