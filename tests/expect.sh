#!/bin/sh
# Runs a command for a test: passes when its exit code is CODE and its output (stdout and stderr)
# matches PATTERN (grep -E over the whole output, so `.*` may span lines). Both, always: a
# program that prints what was expected and then crashes fails. Exit code 77 (a test that skips
# itself, e.g. without a GPU) is passed on unless it is the one expected: ctest counts it as
# skipped where the test sets SKIP_RETURN_CODE 77 (the CUDA ones), as a failure elsewhere.
#   expect.sh CODE PATTERN COMMAND [ARGS...]
code=$1; pattern=$2; shift 2
out=$("$@" 2>&1); rc=$?
echo "$out"
[ "$rc" -eq 77 ] && [ "$code" -ne 77 ] && { echo "skipped (exit code 77)"; exit 77; }
[ "$rc" -eq "$code" ] || { echo "expected exit code $code, got $rc"; exit 1; }
printf '%s' "$out" | grep -Ezq -- "$pattern" || { echo "output does not match: $pattern"; exit 1; }
