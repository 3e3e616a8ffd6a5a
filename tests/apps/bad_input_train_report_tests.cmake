# Bad input to `strata train` and `strata report` (uses strata_flag_error_test).
# Each is refused before any work: no training step, no measurement (FAIL_REGULAR_EXPRESSION).
# A pattern holds no ';': the property is a list, and each piece alone would pass the test.
set(STRATA_BAD_INPUT_DIR ${CMAKE_CURRENT_BINARY_DIR}/bad-input-train-report)
file(MAKE_DIRECTORY ${STRATA_BAD_INPUT_DIR})
set(STRATA_NO_WORK "step +1/|calibrate: copies")

# `sh -c SCRIPT` with the strata binary as $1 (for values a CMake argument cannot carry: control
# characters, an empty string, a temporary FIFO).
function(strata_sh_error_test name pattern script)
  string(REPLACE ";" "." pattern "${pattern}")  # a ';' would split the pattern into alternatives
  add_test(NAME apps.${name} COMMAND sh -c "${script}" sh $<TARGET_FILE:strata_cli>)
  set_tests_properties(apps.${name} PROPERTIES LABELS apps TIMEOUT 60 PASS_REGULAR_EXPRESSION "${pattern}"
                       FAIL_REGULAR_EXPRESSION "${STRATA_NO_WORK}")
endfunction()
function(strata_no_work name)
  set_tests_properties(apps.${name} PROPERTIES FAIL_REGULAR_EXPRESSION "${STRATA_NO_WORK}")
endfunction()

# 1. --save-dir is checked before the engine is built, not at the first save.
strata_flag_error_test(train_save_dir_missing_parent
  "--save-dir '.*/no-such-folder/ck': its parent folder '.*/no-such-folder' does not exist. create it first"
  train --preset tiny --steps 4 --save-every 3 --save-dir ${STRATA_BAD_INPUT_DIR}/no-such-folder/ck)
strata_no_work(train_save_dir_missing_parent)
strata_flag_error_test(train_save_dir_regular_file "--save-dir '.*/CMakeLists.txt' is a regular file, not a folder"
  train --preset tiny --steps 4 --save-every 3 --save-dir ${CMAKE_CURRENT_SOURCE_DIR}/CMakeLists.txt)
strata_no_work(train_save_dir_regular_file)
strata_sh_error_test(train_save_dir_fifo "--save-dir '.*/fifo' is a FIFO, not a folder"
  "d=$(mktemp -d) && mkfifo $d/fifo && \"$1\" train --preset tiny --steps 2 --save-dir $d/fifo; rm -rf $d")
strata_sh_error_test(train_save_dir_empty "--save-dir is empty" "\"$1\" train --steps 2 --save-dir ''")
# A missing last folder is fine (the first save creates it, in its existing parent).
add_test(NAME apps.train_save_dir_created_by_the_save
  COMMAND sh -c "d=$(mktemp -d) && \"$1\" train --preset tiny --steps 2 --batch 2 --seq 16 --eval-every 0 --quiet --save-dir $d/ck/ && test -f $d/ck/latest && echo saved-in-new-folder; rm -rf $d"
          sh $<TARGET_FILE:strata_cli>)
set_tests_properties(apps.train_save_dir_created_by_the_save PROPERTIES LABELS apps TIMEOUT 120
  PASS_REGULAR_EXPRESSION "saved-in-new-folder")

# 2. report --calibrate --out is checked before measuring; --out and --calibrate-* need --calibrate.
strata_flag_error_test(report_calibrate_out_folder "--out '.*' is a folder. give a file path inside it"
  report --calibrate --out ${STRATA_BAD_INPUT_DIR})
strata_no_work(report_calibrate_out_folder)
strata_flag_error_test(report_calibrate_out_missing_folder "--out '.*/no-such-folder/p.json': its folder '.*' does not exist"
  report --calibrate --out ${STRATA_BAD_INPUT_DIR}/no-such-folder/p.json)
strata_no_work(report_calibrate_out_missing_folder)
strata_sh_error_test(report_calibrate_out_empty "--out is empty" "\"$1\" report --calibrate --out ''")
strata_flag_error_test(report_out_without_calibrate
  "strata report: error: --out belongs to --calibrate .*. add --calibrate, or drop it"
  report --out ${STRATA_BAD_INPUT_DIR}/p.json)
strata_flag_error_test(report_calibrate_options_without_calibrate
  "strata report: error: --calibrate-model, --calibrate-batch belong to --calibrate"
  report --calibrate-model small --calibrate-batch 2)

# 3. --stage out of 0..3, and model shapes outside what the model accepts (an explicit 0 included).
strata_flag_error_test(train_stage_negative "--stage -1 is not 0, 1, 2 or 3" train --stage -1 --steps 1)
strata_no_work(train_stage_negative)
strata_flag_error_test(train_layers_zero "--layers: Value 0 not in range 1 to 1024" train --layers 0)
strata_flag_error_test(train_heads_zero "--heads: Value 0 not in range 1 to 65536" train --heads 0)
strata_flag_error_test(train_embd_zero "--embd: Value 0 not in range 1 to 65536" train --embd 0)
strata_flag_error_test(train_max_seq_zero "--max-seq: Value 0 not in range 1 to 65536" train --max-seq 0)
strata_flag_error_test(train_vocab_zero "--vocab: Value 0 not in range 256 to 16777216" train --vocab 0)
strata_flag_error_test(train_embd_over_model "--embd: Value 65537 not in range 1 to 65536" train --embd 65537)
strata_flag_error_test(train_help_model_ranges
  "--layers INT:INT in \\[1 - 1024\\].*--embd INT:INT in \\[1 - 65536\\].*--max-seq INT:INT in \\[1 - 65536\\]"
  train --help)

# 4. The flags cannot make a placement the config check refuses.
strata_flag_error_test(train_stage0_offload_optimizer_flags
  "--stage 0 with --offload-optimizer cpu: optimizer offload needs ZeRO stage 1, 2 or 3"
  train --stage 0 --offload-optimizer cpu --steps 1)
strata_no_work(train_stage0_offload_optimizer_flags)
file(WRITE ${STRATA_BAD_INPUT_DIR}/stage0.json "{\"zero_optimization\": {\"stage\": 0}}")
strata_flag_error_test(train_config_stage0_offload_optimizer_flag
  "stage 0 \\(zero_optimization.stage of --config '.*/stage0.json'\\) with --offload-optimizer cpu: optimizer offload needs"
  train --config ${STRATA_BAD_INPUT_DIR}/stage0.json --offload-optimizer cpu --steps 1)

# 5. User values in messages are escaped, line breaks included (printf 'a\nb').
strata_sh_error_test(train_device_escaped "--device 'a\\\\x0ab' is not a device. use cpu, cuda or auto"
  "\"$1\" train --device \"$(printf 'a\\nb')\"")
strata_sh_error_test(train_preset_escaped "--preset: unknown model preset 'a\\\\x0ab'. valid presets"
  "\"$1\" train --preset \"$(printf 'a\\nb')\"")
strata_sh_error_test(train_backend_escaped "--backend 'a\\\\x0ab' is not a backend. use local, mpi or nccl"
  "\"$1\" train --backend \"$(printf 'a\\nb')\"")
strata_sh_error_test(train_json_log_escaped "open --json-log '.*/no-such-folder/a\\\\x0ab.json'"
  "\"$1\" train --preset tiny --steps 1 --json-log \"${STRATA_BAD_INPUT_DIR}/no-such-folder/$(printf 'a\\nb').json\"")
strata_sh_error_test(train_nvme_path_escaped
  "--nvme-path '.*/no-such-folder/a\\\\x0ab': the folder for the swap files cannot be used"
  "\"$1\" train --preset tiny --steps 1 --stage 2 --offload-optimizer nvme --nvme-path \"${STRATA_BAD_INPUT_DIR}/no-such-folder/$(printf 'a\\nb')\"")
strata_flag_error_test(train_nvme_path_regular_file "--nvme-path '.*/CMakeLists.txt' is a regular file, not a folder"
  train --preset tiny --steps 1 --stage 2 --offload-optimizer nvme --nvme-path ${CMAKE_CURRENT_SOURCE_DIR}/CMakeLists.txt)
strata_sh_error_test(report_calibrate_model_escaped "--calibrate-model: unknown model preset 'a\\\\x0ab'. valid presets"
  "\"$1\" report --calibrate --calibrate-model \"$(printf 'a\\nb')\"")
strata_sh_error_test(report_calibrate_device_escaped "--calibrate-device 'a\\\\x0ab' is not a device"
  "\"$1\" report --calibrate --calibrate-device \"$(printf 'a\\nb')\"")
# The preset message names no flag of its own: each command's flag comes first.
strata_flag_error_test(estimate_model_names_its_flag "--model: unknown model preset 'huge'. valid presets"
  estimate --model huge)
set_tests_properties(apps.estimate_model_names_its_flag PROPERTIES FAIL_REGULAR_EXPRESSION "\\(--preset\\)")

# 6. Messages name the flag, not the engine's field; no floating-point flag takes NaN.
strata_flag_error_test(train_grad_accum_zero "--grad-accum: Value 0 not in range 1 to 1000000" train --grad-accum 0)
strata_flag_error_test(train_eval_batches_negative "--eval-batches: Value -1 not in range 1 to 1000000"
  train --eval-batches -1)
strata_flag_error_test(train_clip_nan "--clip: nan is not a number. give a finite number" train --clip nan)
strata_flag_error_test(train_lr_nan "--lr: nan is not a number" train --lr nan)
strata_flag_error_test(train_clip_too_large "--clip: Value 1e7 not in range" train --clip 1e7)
strata_flag_error_test(bench_offload_clip_nan "--clip: nan is not a number" bench offload --clip nan)

# 7. --help says what --device defaults to.
strata_flag_error_test(train_help_device_default
  "--device TEXT +cpu \\| cuda \\| auto .*default: the config's[ \n]+strata.device \\(auto unless set\\) with --config or --fit, else cpu"
  train --help)
set_tests_properties(apps.train_help_device_default PROPERTIES FAIL_REGULAR_EXPRESSION "--device TEXT=cpu")
