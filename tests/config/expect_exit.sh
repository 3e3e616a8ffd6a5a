#!/bin/sh
# expect_exit.sh RC PATTERN COMMAND...: runs COMMAND, passes when it exits
# with RC and its output (stdout + stderr) matches the extended regex PATTERN.
expected=$1
pattern=$2
shift 2
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ "$rc" -ne "$expected" ]; then
  echo "FAIL: expected exit code $expected, got $rc"
  exit 1
fi
# Newlines become spaces so that one pattern can span several lines.
if ! printf '%s\n' "$out" | tr '\n' ' ' | grep -Eq -- "$pattern"; then
  echo "FAIL: output does not match: $pattern"
  exit 1
fi
echo "PASS"
