#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, then configures, builds and
# runs tests/apps/consumer against it with find_package(Strata).
set -euo pipefail
build_dir="$1"
source_dir="$2"
work="$(mktemp -d "${TMPDIR:-/tmp}/strata-consumer.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/Strata/StrataConfig.cmake"
test -f "$work/prefix/include/strata/core/status.h"
test -x "$work/prefix/bin/strata"
"$work/prefix/bin/strata" --version
# The testing seam (Note [Testing seam]: strata_offload_testing, its headers,
# the strata-testing binary) is not installed.
for leak in "$work/prefix/bin/strata-testing" "$work/prefix/include/strata/offload/testing"; do
  if test -e "$leak"; then echo "FAIL: $leak was installed"; exit 1; fi
done
if find "$work/prefix" -name '*strata_offload_testing*' | grep -q .; then
  echo "FAIL: strata_offload_testing was installed"; exit 1
fi
# The plotting script of `strata bench offload --plot` is installed, and the
# installed strata finds it there (before the source tree): with matplotlib
# hidden, the error names the script it would have run, before any row runs.
test -x "$work/prefix/share/strata/plot_offload.py"
mkdir -p "$work/fake-python"
printf 'raise ImportError("hidden")\n' > "$work/fake-python/matplotlib.py"
plot_out=$(PYTHONPATH="$work/fake-python" "$work/prefix/bin/strata" bench offload --plot "$work/out.png" 2>&1) &&
  { echo "$plot_out"; echo "FAIL: bench offload --plot ran without matplotlib"; exit 1; }
echo "$plot_out" | grep -q "to run .*prefix/share/strata/plot_offload.py" ||
  { echo "$plot_out"; echo "FAIL: the installed strata did not find the installed plot_offload.py"; exit 1; }
cmake -S "$source_dir/tests/apps/consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/build/consumer"
