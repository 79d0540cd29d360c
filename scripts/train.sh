#!/usr/bin/env bash
# Sets up (when needed), builds, and trains. With no --config / @ FILE argument it runs the
# embedded default, configs/debug/quickstart.toml, and ends by printing a sample of what the model
# writes (scripts/watch/sample.py on its checkpoint); every argument goes to train_fsdp.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/build.sh" programs >/dev/null
args=("$@")
quickstart=0
if [[ " ${args[*]-} " != *" --config "* && " ${args[*]-} " != *" @"* && " ${args[*]-} " != *" --help "* ]]; then
  args=(--config "$ROOT/configs/debug/quickstart.toml" "${args[@]}")
  quickstart=1
fi
cd "$ROOT"
bin=${BUILD_DIR:-$ROOT/build}/apps
[ $quickstart = 1 ] || exec "$bin/train_fsdp" "${args[@]}"
"$bin/train_fsdp" "${args[@]}"
ckpt=outputs/quickstart/ckpt
if [ -f "$ckpt/latest" ]; then
  echo "== a sample from $ckpt/$(cat "$ckpt/latest") (scripts/watch/sample.py; plots: scripts/watch/plot_runs.py outputs/quickstart -o quickstart.png)"
  .venv/bin/python scripts/watch/sample.py "$ckpt/$(cat "$ckpt/latest")" --prompt "The " --max-new-tokens 60 --export-hf "$bin/export_hf"
fi
