#!/usr/bin/env bash
# Issue 16 regression tests for the nvme CLI commands, as a new user's
# hostile inputs (each case: what must happen, checked by its effect):
#  - swap clean never follows a `strata-*` link nor deletes outside --path;
#  - io-bench --file stays inside --path and overwrites only its own files;
#  - a FIFO or a link to /dev/zero named `lock` neither blocks nor is read
#    without bound by swap list / report --path;
#  - numeric flags that would wrap are refused naming the flag and range.
#   cli_hostile_input_test.sh STRATA_BINARY SCRATCH_DIR
set -uo pipefail
strata="$1"; scratch="$2"
rm -rf "$scratch"; mkdir -p "$scratch"
P="$scratch/nvme"; elsewhere="$scratch/elsewhere"; mkdir -p "$P" "$elsewhere"
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
# Runs with a time bound: a hang is a failure, not a stuck test.
run() { timeout 20 "$strata" "$@"; }

# 1. A symlinked job folder is refused and its target untouched.
mkdir -p "$elsewhere/rank0"; echo keep > "$elsewhere/rank0/data"; echo "state=open" > "$elsewhere/rank0/lock"
ln -s "$elsewhere" "$P/strata-x"
# A symlinked rank folder inside a real job folder too.
mkdir -p "$P/strata-y" "$elsewhere/victim"; echo keep > "$elsewhere/victim/data"
ln -s "$elsewhere/victim" "$P/strata-y/rank0"
# A real stale folder holding a link to a file outside: the link goes, the file stays.
mkdir -p "$P/strata-z/rank0"; echo keep > "$elsewhere/target"; ln -s "$elsewhere/target" "$P/strata-z/rank0/swap.bin"
out=$(run swap clean --path "$P" 2>&1); rc=$?
[[ $rc -eq 0 ]] || fail "swap clean exit $rc: $out"
[[ -f "$elsewhere/rank0/data" && -f "$elsewhere/rank0/lock" ]] || fail "swap clean deleted through the strata-x link"
[[ -f "$elsewhere/victim/data" ]] || fail "swap clean deleted through the rank0 link"
[[ -f "$elsewhere/target" ]] || fail "swap clean deleted the target of a link inside a swap folder"
[[ -L "$P/strata-x" ]] || fail "swap clean removed the strata-x link itself (it must only refuse)"
[[ ! -e "$P/strata-z" ]] || fail "swap clean left the real stale folder strata-z"
grep -q "strata-x is a symbolic link (to $elsewhere): not followed" <<<"$out" || fail "no clear message for strata-x: $out"
grep -q "strata-y/rank0 is a symbolic link" <<<"$out" || fail "no clear message for strata-y/rank0: $out"
rm -rf "$P"/strata-*

# 3. A FIFO `lock` must not block; a lock linked to /dev/zero must not be read.
mkdir -p "$P/strata-fifo/rank0" "$P/strata-zero/rank0"
mkfifo "$P/strata-fifo/rank0/lock"
ln -s /dev/zero "$P/strata-zero/rank0/lock"
out=$(run swap list --path "$P" 2>&1); rc=$?
[[ $rc -eq 0 ]] || fail "swap list with a FIFO / /dev/zero lock: exit $rc (124 = hung): $out"
grep -q "strata-fifo/rank0/lock is a FIFO, not a lock file" <<<"$out" || fail "no message for the FIFO lock: $out"
grep -q "strata-zero/rank0/lock is a symbolic link, not a lock file" <<<"$out" || fail "no message for the /dev/zero lock: $out"
out=$(run report --path "$P" 2>&1); rc=$?
[[ $rc -eq 0 ]] || fail "report --path with a FIFO lock: exit $rc (124 = hung): $out"
out=$(run swap clean --path "$P" 2>&1); rc=$?
[[ $rc -eq 0 && ! -e "$P/strata-fifo" && ! -e "$P/strata-zero" ]] || fail "swap clean of odd lock files: exit $rc: $out"

# 6. Names from the file system are escaped (no forged lines) and non-UTF-8 names do not break --json.
mkdir -p "$P/strata-a"$'\n'"OK fake/rank0" "$P/strata-"$'\xff'"/rank0"
out=$(run swap list --path "$P" 2>&1); rc=$?
[[ $rc -eq 0 ]] || fail "swap list with odd names: exit $rc: $out"
grep -q '^OK fake' <<<"$out" && fail "a folder name forged a line of swap list output: $out"
grep -qF 'strata-a\x0aOK fake' <<<"$out" || fail "the newline in a folder name is not escaped: $out"
out=$(run swap list --path "$P" --json 2>&1) || fail "swap list --json with a non-UTF-8 folder name: $out"
rm -rf "$P"/strata-*

# 2. io-bench --file is confined to --path and does not overwrite others' files.
bench() { run io-bench --path "$P" --size 1MiB --block-size 256KiB --queue-depth 2 --mode write "$@"; }
mkdir -p "$P/sub"
out=$(bench --file ../x.dat 2>&1) && fail "io-bench accepted --file ../x.dat"
grep -q -- "--file ../x.dat: must be a file name inside --path" <<<"$out" || fail "unclear --file .. message: $out"
[[ ! -e "$scratch/x.dat" ]] || fail "io-bench wrote outside --path"
out=$(bench --file "$scratch/x.dat" 2>&1) && fail "io-bench accepted an absolute --file outside --path"
grep -q "outside --path" <<<"$out" || fail "unclear absolute --file message: $out"
ln -s "$elsewhere/target" "$P/link.dat"
out=$(bench --file link.dat --overwrite 2>&1) && fail "io-bench followed a --file link"
grep -q "is a symbolic link" <<<"$out" || fail "unclear --file link message: $out"
[[ "$(cat "$elsewhere/target")" == keep ]] || fail "io-bench wrote through a link"
echo precious > "$P/existing.dat"
out=$(bench --file existing.dat 2>&1) && fail "io-bench overwrote a file it did not create"
grep -q "was not created by io-bench" <<<"$out" || fail "unclear overwrite message: $out"
[[ "$(cat "$P/existing.dat")" == precious ]] || fail "io-bench changed existing.dat without --overwrite"
out=$(bench --file existing.dat --overwrite 2>&1) || fail "io-bench --overwrite refused: $out"
out=$(bench --file mine.dat 2>&1) || fail "io-bench --file mine.dat: $out"
out=$(bench --file mine.dat 2>&1) || fail "io-bench refused to reuse its own file: $out"
out=$(bench --file "$P/mine.dat" 2>&1) || fail "io-bench refused an absolute --file inside --path: $out"
ls "$P"/strata-io-bench-* >/dev/null 2>&1 && fail "io-bench left its temporary file"

# 5. Numeric flags: out of range (and values that wrap at 32 or 64 bits) are refused.
check_flag() {  # expected-text args...
  local want="$1"; shift
  out=$(run io-bench --path "$P" --size 1MiB "$@" 2>&1) && fail "io-bench accepted $*"
  grep -qF -- "$want" <<<"$out" || fail "io-bench $*: expected '$want', got: $out"
}
check_flag "--sweep-queue-depths 4294967297: must be a whole number between 1 and 32768" --sweep --sweep-queue-depths 4294967297
check_flag "--sweep-threads 0: must be a whole number between 1 and 256" --sweep --sweep-threads 0
check_flag "--queue-depth 4294967297: must be a whole number between 1 and 32768" --queue-depth 4294967297
check_flag "--queue-depth -1: must be a whole number between 1 and 32768" --queue-depth -1
check_flag "--threads 99999999999999999999: must be a whole number between 1 and 256" --threads 99999999999999999999
check_flag "--block-size 18446744073709551616: must be a multiple of 512 bytes between 512 and 1GiB" --block-size 18446744073709551616
check_flag "--sweep-block-sizes 100: must be a multiple of 512 bytes between 512 and 1GiB" --sweep --sweep-block-sizes 100

rm -rf "$scratch"
if (( failures > 0 )); then echo "$failures failure(s)" >&2; exit 1; fi
echo "all hostile-input cases passed"
