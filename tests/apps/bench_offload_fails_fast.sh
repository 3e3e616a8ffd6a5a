#!/bin/sh
# strata bench offload checks every output option and the NVMe rows' folder
# before it measures anything (issue 22, defect 15): each bad one below ends
# the bench at once with an error naming the culprit, and no row runs (no
# header, no "repeat" line).
# Usage: bench_offload_fails_fast.sh STRATA ROWS.json WORKDIR
set -u
strata=$1 rows=$2 dir=$3
rm -rf "$dir"
mkdir -p "$dir/nvme" "$dir/fake-python"
# A python path on which `import matplotlib` fails, for every python3.
printf 'raise ImportError("matplotlib hidden by bench_offload_fails_fast.sh")\n' > "$dir/fake-python/matplotlib.py"
STRATA_NVME_DIR="$dir/nvme"
export STRATA_NVME_DIR
failures=0
# expect NAME PATTERN ARGS...: `strata bench offload ARGS` fails (exit 1 or 2), its
# output matches the extended regex PATTERN, and it measured nothing.
expect() {
  name=$1 pattern=$2
  shift 2
  out=$("$strata" bench offload --configs "$rows" --repeats 1 --steps 1 --warmup 0 --batch 1 --seq 16 "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne 1 ] && [ "$rc" -ne 2 ]; then
    echo "FAIL $name: exit code $rc, expected an error (1 or 2):"; echo "$out"; failures=$((failures + 1)); return
  fi
  if ! printf '%s\n' "$out" | grep -Eq -- "$pattern"; then
    echo "FAIL $name: the error does not match: $pattern"; echo "$out"; failures=$((failures + 1)); return
  fi
  if printf '%s\n' "$out" | grep -Eq '^bench offload:|repeat 1/1'; then
    echo "FAIL $name: rows were measured before the error:"; echo "$out"; failures=$((failures + 1)); return
  fi
  echo "ok   $name: $(printf '%s\n' "$out" | head -n 1)"
}
expect missing_plot_script "--plot-script '.*/no_such_plot.py' is not a file" \
  --plot "$dir/out.png" --plot-script "$dir/no_such_plot.py"
PYTHONPATH="$dir/fake-python"
export PYTHONPATH
expect no_matplotlib "--plot needs python3 with matplotlib to run .*plot_offload.py.*apt-get install python3-matplotlib" \
  --plot "$dir/out.png"
unset PYTHONPATH
expect plot_folder_missing "--plot '.*/no_such_dir/out.png': its folder '.*/no_such_dir' does not exist" \
  --plot "$dir/no_such_dir/out.png"
expect json_folder_missing "--json '.*/no_such_dir/out.json': its folder '.*/no_such_dir' does not exist" \
  --json "$dir/no_such_dir/out.json"
expect csv_is_a_folder "--csv '.*' is a folder; give a file path inside it" --csv "$dir"
expect plot_script_without_plot "--plot-script is for --plot FILE.png" --plot-script "$dir/fake-python/matplotlib.py"
STRATA_NVME_DIR="$dir/no_such_nvme"
expect nvme_default_missing \
  "the NVMe rows' folder '.*/no_such_nvme' \(\\\$STRATA_NVME_DIR\) is not a directory; give --nvme-path DIR"
if [ "$failures" -ne 0 ]; then
  echo "FAIL: $failures case(s)"
  exit 1
fi
echo "bench offload fails fast OK"
