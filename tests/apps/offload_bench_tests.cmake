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
    set_tests_properties(apps.bench_offload_${mode} PROPERTIES LABELS apps TIMEOUT 300 SKIP_RETURN_CODE 77
      PASS_REGULAR_EXPRESSION "bench offload ${mode} ok|skipped")
  endforeach()
endif()

# Bad input names the culprit.
function(strata_offload_error_test name pattern)
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
strata_offload_error_test(bench_offload_missing_configs "open row file '.*no_such_rows.json'.*No such file"
  bench offload --configs ${bad}/no_such_rows.json)
strata_offload_error_test(bench_offload_rows_unknown_key
  "offload_rows_bad_key.json: rows\\[1\\]: unknown key 'ofload_param'" bench offload --configs ${bad}/offload_rows_bad_key.json)
strata_offload_error_test(bench_offload_rows_bad_ratio "rows\\[0\\].ratio: 1.5 is not in \\(0, 1\\]"
  bench offload --configs ${bad}/offload_rows_bad_ratio.json)
strata_offload_error_test(bench_offload_rows_bad_combo "rows\\[0\\] \\(s2 opt=cpu param=cpu bf16\\): parameter offload needs stage 3"
  bench offload --configs ${bad}/offload_rows_bad_combo.json)
strata_offload_error_test(bench_offload_nvme_path_not_dir "--nvme-path '.*offload_rows.json' is not a directory"
  bench offload --nvme-path ${STRATA_OFFLOAD_ROWS})
strata_offload_error_test(bench_offload_seq_too_long "--seq 65 is longer than the model's max_seq 64"
  bench offload --seq 65)
