#!/usr/bin/env bash
# Sets up (when needed), builds, and trains. With no --config / @ FILE argument it runs the
# embedded default, configs/debug/quickstart.toml; every argument goes to train_fsdp.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/build.sh" >/dev/null
args=("$@")
if [[ " ${args[*]-} " != *" --config "* && " ${args[*]-} " != *" @"* && " ${args[*]-} " != *" --help "* ]]; then
  args=(--config "$ROOT/configs/debug/quickstart.toml" "${args[@]}")
fi
cd "$ROOT"
exec "${BUILD_DIR:-$ROOT/build}/apps/train_fsdp" "${args[@]}"
