#!/usr/bin/env bash
# Sets up (when needed), builds and runs the whole test suite with ctest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/build.sh"
cd "${BUILD_DIR:-$ROOT/build}"
ctest --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 600 "$@"
