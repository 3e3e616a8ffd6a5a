# strata bench offload / strata plan / strata report --calibrate (issue 14):
# tiny models, 1-2 steps; times are never asserted (docs/performance.md has them).
set(STRATA_OFFLOAD_WORK ${CMAKE_CURRENT_BINARY_DIR}/offload-bench)
set(STRATA_OFFLOAD_ROWS ${CMAKE_CURRENT_SOURCE_DIR}/data/offload_rows.json)
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  foreach(mode schema nofit csv plot)
    add_test(NAME apps.bench_offload_${mode}
      COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/check_bench_offload.py $<TARGET_FILE:strata_cli>
              ${STRATA_OFFLOAD_ROWS} ${STRATA_OFFLOAD_WORK}/${mode} ${mode})
    # Skipped (exit 77) only when matplotlib is missing; a FAIL line fails the test even when it
    # quotes a row whose status is "skipped".
    set_tests_properties(apps.bench_offload_${mode} PROPERTIES LABELS apps TIMEOUT 300 SKIP_RETURN_CODE 77
      PASS_REGULAR_EXPRESSION "bench offload ${mode} ok|matplotlib is missing \\(apt-get install python3-matplotlib\\): skipped"
      FAIL_REGULAR_EXPRESSION "FAIL: ")
  endforeach()
endif()

# Bad input names the culprit.
function(strata_offload_error_test name pattern)
  string(REPLACE ";" "." pattern "${pattern}")  # a ';' would split the pattern into alternatives
  add_test(NAME apps.${name} COMMAND strata_cli ${ARGN})
  set_tests_properties(apps.${name} PROPERTIES LABELS apps TIMEOUT 60 PASS_REGULAR_EXPRESSION "${pattern}")
endfunction()
set(bad ${CMAKE_CURRENT_SOURCE_DIR}/data)
strata_offload_error_test(bench_offload_bad_matrix "--matrix 'everything' is not 'default'"
  bench offload --matrix everything)
strata_offload_error_test(bench_offload_bad_dtype "--dtype 'fp64' is not a parameter dtype"
  bench offload --dtype bf16,fp64)
strata_offload_error_test(bench_offload_bad_ranks "--ranks: Value 0 not in range 1 to 64" bench offload --ranks 0)
strata_offload_error_test(bench_offload_bad_steps "--steps: Value 0 not in range" bench offload --steps 0)
strata_offload_error_test(bench_offload_bad_clip "--clip: Value -1 not in range" bench offload --clip -1)
strata_offload_error_test(bench_offload_missing_configs "open row file '.*no_such_rows.json'.*No such file"
  bench offload --configs ${bad}/no_such_rows.json)
strata_offload_error_test(bench_offload_rows_unknown_key
  "offload_rows_bad_key.json: rows\\[1\\]: unknown key 'ofload_param'" bench offload --configs ${bad}/offload_rows_bad_key.json)
strata_offload_error_test(bench_offload_rows_bad_ratio "rows\\[0\\].ratio: 1.5 is not in \\(0, 1\\]"
  bench offload --configs ${bad}/offload_rows_bad_ratio.json)
strata_offload_error_test(bench_offload_rows_bad_combo "rows\\[0\\] \\(s2 opt=cpu param=cpu bf16\\): parameter offload needs stage 3"
  bench offload --configs ${bad}/offload_rows_bad_combo.json)
strata_offload_error_test(bench_offload_rows_int8_on_device
  "rows\\[0\\] \\(s2 opt=none param=none bf16 m=int8\\): int8 optimizer states need the optimizer state offloaded"
  bench offload --configs ${bad}/offload_rows_bad_moments.json)
strata_offload_error_test(bench_offload_rows_bad_moment_name
  "rows\\[0\\].optimizer_state_dtype 'int4' is not a moment storage; use fp32, bf16 or int8"
  bench offload --configs ${bad}/offload_rows_bad_moment_name.json)
strata_offload_error_test(bench_offload_rows_gradient_shards_need_nvme_state
  "rows\\[0\\] \\(s2 opt=cpu param=none bf16 grads=nvme\\): gradient shards on NVMe: neither the optimizer state \\(offload_optimizer.device nvme\\) nor the parameter shards"
  bench offload --configs ${bad}/offload_rows_bad_gradient_shards.json)
strata_offload_error_test(bench_offload_rows_speculation_needs_offloaded_state
  "rows\\[0\\] \\(s2 opt=none param=none bf16 early=on\\): speculative_optimizer on needs the optimizer state offloaded"
  bench offload --configs ${bad}/offload_rows_bad_speculation.json)
strata_offload_error_test(bench_offload_rows_bad_speculation_name
  "rows\\[0\\].speculative_optimizer 'maybe' is not auto, on or off"
  bench offload --configs ${bad}/offload_rows_bad_speculation_name.json)
strata_offload_error_test(bench_offload_rows_bad_pipeline "rows\\[0\\].pipeline_read: \"yes\" is not true or false"
  bench offload --configs ${bad}/offload_rows_bad_pipeline.json)
strata_offload_error_test(bench_offload_rows_pipeline_needs_nvme_state
  "rows\\[0\\] \\(s2 opt=cpu param=none bf16 pipe=w\\): pipeline_read and pipeline_write are the NVMe optimizer tier's"
  bench offload --configs ${bad}/offload_rows_pipeline_not_nvme.json)
strata_offload_error_test(bench_offload_bad_optimizer_states "--optimizer-states 'fp16' is not a moment storage"
  bench offload --optimizer-states fp32,fp16)
strata_offload_error_test(bench_offload_nvme_path_not_dir "--nvme-path '.*offload_rows.json' is not a directory"
  bench offload --nvme-path ${STRATA_OFFLOAD_ROWS})
# Every output option and the NVMe rows' folder are checked before any row runs (issue 22, defect 15).
add_test(NAME apps.bench_offload_fails_fast
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/bench_offload_fails_fast.sh $<TARGET_FILE:strata_cli> ${STRATA_OFFLOAD_ROWS}
          ${STRATA_OFFLOAD_WORK}/fails-fast)
set_tests_properties(apps.bench_offload_fails_fast PROPERTIES LABELS apps TIMEOUT 120
  PASS_REGULAR_EXPRESSION "bench offload fails fast OK")
strata_offload_error_test(bench_offload_seq_too_long "--seq 65 is longer than the model's max_seq 64"
  bench offload --seq 65)

# strata plan: memory equals the estimator's / the engine's plan, bytes per link
# equal the engine's, the shipped profiles plan 13B.
if(Python3_Interpreter_FOUND)
  foreach(mode estimator engine profiles)
    add_test(NAME apps.plan_${mode}
      COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/check_plan.py $<TARGET_FILE:strata_cli>
              ${PROJECT_SOURCE_DIR} ${STRATA_OFFLOAD_WORK}/plan-${mode} ${mode})
    set_tests_properties(apps.plan_${mode} PROPERTIES LABELS apps TIMEOUT 300
      PASS_REGULAR_EXPRESSION "plan ${mode} ok")
  endforeach()
endif()
set(profile ${CMAKE_CURRENT_SOURCE_DIR}/data/test_profile.json)
strata_offload_error_test(plan_needs_profile "give --profile P.json" plan --params 13B)
# Without --optimizer-states the rows keep the config's moments (here int8), in the plan's memory and model.
strata_offload_error_test(plan_rows_keep_the_configs_moments "\"optimizer_state_dtype\": ?\"int8\""
  plan --model tiny --profile ${CMAKE_CURRENT_SOURCE_DIR}/data/test_profile.json
  --config ${CMAKE_CURRENT_SOURCE_DIR}/data/int8_offload.json --json)
strata_offload_error_test(plan_fit_bad_optimizer_states "--optimizer-states 'int4' is not a moment storage"
  plan --fit --model tiny --profile ${CMAKE_CURRENT_SOURCE_DIR}/data/test_profile.json --device-memory 1GiB
  --host-memory 1GiB --optimizer-states fp32,int4 --json)
strata_offload_error_test(plan_params_or_model "give exactly one of --params .* or --model"
  plan --params 13B --model tiny --profile ${profile})
strata_offload_error_test(plan_missing_profile "open hardware profile '.*no_such_profile.json'.*No such file"
  plan --params 13B --profile ${bad}/no_such_profile.json)
strata_offload_error_test(plan_bad_params "--params" plan --params 13Q --profile ${profile})
# Bad profiles name the key.
file(READ ${profile} good_profile)
function(strata_bad_profile name find replace pattern)
  string(REPLACE "${find}" "${replace}" text "${good_profile}")
  file(WRITE ${STRATA_OFFLOAD_WORK}/${name}.json "${text}")
  strata_offload_error_test(plan_profile_${name} "${pattern}" plan --params 1B --profile ${STRATA_OFFLOAD_WORK}/${name}.json)
endfunction()
strata_bad_profile(missing_rate "\"h2d_gb_per_s\": 10, " ""
  "missing_rate.json: \"h2d_gb_per_s\" is missing \\(every rate is required")
strata_bad_profile(negative_rate "\"nvme_write_gb_per_s\": 1" "\"nvme_write_gb_per_s\": -1"
  "\"nvme_write_gb_per_s\" is -1; it must be a positive number")
strata_bad_profile(zero_rate "\"compute_gflops\": 50" "\"compute_gflops\": 0"
  "\"compute_gflops\" is 0; it must be a positive number")
strata_bad_profile(string_rate "\"d2h_gb_per_s\": 10" "\"d2h_gb_per_s\": \"fast\""
  "\"d2h_gb_per_s\" is \"fast\", not a number")
strata_bad_profile(unknown_key "\"h2d_gb_per_s\"" "\"h2d_gbps\""
  "unknown key \"h2d_gbps\" \\(known: name, gpus_per_node")
strata_bad_profile(shared_cores_string "\"shared_cores\": true" "\"shared_cores\": \"true\""
  "\"shared_cores\" is \"true\"; write true or false without quotes")
strata_bad_profile(adam_missing_bf16 ", \"bf16\": 1e9" ""
  "cpu_adam_params_per_s: \"bf16\" is missing")
strata_bad_profile(adam_unknown_mix "\"bf16\": 1e9" "\"fp8\": 1e9"
  "unknown key \"cpu_adam_params_per_s.fp8\" \\(known: fp32, bf16, int8\\)")
strata_bad_profile(gpus_per_node_range "\"gpus_per_node\": 1" "\"gpus_per_node\": 0"
  "\"gpus_per_node\" is 0; it must be an integer in 1..4096")

# strata report --calibrate writes a profile that strata plan loads.
file(MAKE_DIRECTORY ${STRATA_OFFLOAD_WORK}/calibrate)
add_test(NAME apps.report_calibrate_profile
  COMMAND sh -c "$<TARGET_FILE:strata_cli> report --calibrate --calibrate-model tiny --calibrate-dtype fp32 --path ${STRATA_OFFLOAD_WORK}/calibrate --out ${STRATA_OFFLOAD_WORK}/calibrate/here.json && ! ls ${STRATA_OFFLOAD_WORK}/calibrate | grep -q strata-calibrate && grep -q '\"dtype\": \"fp32\"' ${STRATA_OFFLOAD_WORK}/calibrate/here.json && $<TARGET_FILE:strata_cli> plan --model tiny --profile ${STRATA_OFFLOAD_WORK}/calibrate/here.json")
set_tests_properties(apps.report_calibrate_profile PROPERTIES LABELS apps TIMEOUT 300
  PASS_REGULAR_EXPRESSION "profile  .*here.json.*plan: tiny.*note: profile .* timed its compute in fp32, these rows train in bf16: recalibrate with .*--calibrate-dtype bf16.*<- fastest that fits")
strata_offload_error_test(report_calibrate_bad_path "--path '.*no_such_dir' is not a directory"
  report --calibrate --path ${STRATA_OFFLOAD_WORK}/no_such_dir)
strata_offload_error_test(report_calibrate_bad_model "--calibrate-model.*huge"
  report --calibrate --calibrate-model huge)
strata_offload_error_test(report_calibrate_bad_ranks "--calibrate-ranks: Value 0 not in range 1 to 64"
  report --calibrate --calibrate-ranks 0)
strata_offload_error_test(bench_offload_bad_device "--device 'gpu' is not a device; use cpu, cuda or auto"
  bench offload --device gpu)
strata_offload_error_test(bench_offload_cuda_ranks "--ranks 2 with --device cuda: the bench runs its ranks as threads"
  bench offload --device cuda --ranks 2)
strata_offload_error_test(report_calibrate_bad_device "--calibrate-device 'gpu' is not a device; use cpu, cuda or auto"
  report --calibrate --calibrate-device gpu)
strata_offload_error_test(report_calibrate_cuda_ranks "--calibrate-ranks 2 with --calibrate-device cuda: a GPU is calibrated with one rank"
  report --calibrate --calibrate-device cuda --calibrate-ranks 2)
strata_offload_error_test(report_calibrate_bad_dtype "--calibrate-dtype 'int8' is not a parameter dtype"
  report --calibrate --calibrate-model tiny --calibrate-dtype int8)
strata_offload_error_test(report_calibrate_device_threads_on_cuda "--calibrate-device-threads 1 with --calibrate-device cuda"
  report --calibrate --calibrate-device cuda --calibrate-device-threads 1)
strata_offload_error_test(report_calibrate_too_many_optimizer_threads "--calibrate-optimizer-threads 4096 is more than this machine's"
  report --calibrate --calibrate-model tiny --calibrate-optimizer-threads 4096)

# The step-time model and hardware profiles on their own (no model, no device).
strata_add_test(strata_step_time_model_tests SOURCES step_time_model_test.cpp LIBS strata_offload LABELS apps)
strata_offload_error_test(bench_offload_plot_not_png "--plot 'out.pdf' must name a .png file"
  bench offload --plot out.pdf)
strata_offload_error_test(bench_offload_bad_profile "--profile: .*no_such_profile.json"
  bench offload --profile ${bad}/no_such_profile.json)
strata_offload_error_test(report_calibrate_bad_config "--calibrate-config.*no_such_config.json"
  report --calibrate --calibrate-model tiny --calibrate-config ${bad}/no_such_config.json)
