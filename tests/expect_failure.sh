#!/bin/sh
# Runs a command that must fail: passes when its exit code is the expected one and its output
# matches the pattern (grep -E).   expect_failure.sh CODE PATTERN COMMAND [ARGS...]
code=$1; pattern=$2; shift 2
out=$("$@" 2>&1); rc=$?
echo "$out"
[ "$rc" -eq "$code" ] || { echo "expected exit code $code, got $rc"; exit 1; }
echo "$out" | grep -Eq -- "$pattern" || { echo "output does not match: $pattern"; exit 1; }
