#!/usr/bin/env bash
# The DDP-vs-FSDP convergence reproduction: trains the same config, data and seed with
# train_fsdp and with train_ddp on NPROC processes, then writes both metrics files, a CSV of the
# two loss curves, a PNG of both runs (scripts/watch/plot_runs.py), and prints the largest and the final
# difference.
#
#   scripts/perf/convergence.sh [CONFIG] [NPROC] [extra train arguments...]
#   scripts/perf/convergence.sh                                    # CPU: configs/debug/convergence.toml, 2 ranks
#   scripts/perf/convergence.sh configs/150M/H100.toml 8 --data.dataset_name_or_paths DATA   # 8 GPUs
#
# Environment: ZB_SKIP_BUILD=1 takes BUILD_DIR (default build) as it is; PYTHON is the python with
# torch that starts the ranks (default .venv/bin/python; a lent GPU machine's own).
#
# Long runs survive preemption: with CKPT_INTERVAL=N both programs checkpoint every N steps under
# OUT/ckpt-<program>, and running the script again with the same OUT resumes each from its latest
# checkpoint (the metrics files are appended to).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
config=${1:-$ROOT/configs/debug/convergence.toml}
nproc=${2:-2}
shift $(( $# > 2 ? 2 : $# ))
[ "${ZB_SKIP_BUILD:-0}" = 1 ] || "$ROOT/scripts/build.sh" >/dev/null
cd "$ROOT"
build=${BUILD_DIR:-build}
python=${PYTHON:-.venv/bin/python}
out=${OUT:-outputs/convergence-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
threads=()
[ -e /dev/nvidia0 ] || threads=(--runtime.num_threads 1)  # CPU ranks share the cores
for app in train_fsdp train_ddp; do
  echo "== $app on $nproc process(es): $config"
  ckpt=()
  if [ -n "${CKPT_INTERVAL:-}" ]; then
    ckpt=(--ckpt.path "$out/ckpt-$app" --ckpt.interval "$CKPT_INTERVAL")
    [ -f "$out/ckpt-$app/latest" ] && ckpt+=(--ckpt.resume latest)
  fi
  "$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" --no-python "$build/apps/$app" \
    --config "$config" --logging.metrics_file "$out/$app.jsonl" "${threads[@]}" "${ckpt[@]}" "$@" 2>&1 \
    | grep -E "step [0-9]+/[0-9]+ \| (loss|val)|done|error|resumed" | awk 'NR % 5 == 1 || /val|done|error|resumed/'
done
"$python" scripts/watch/compare_runs.py "$out/train_fsdp.jsonl" "$out/train_ddp.jsonl" "$out"
"$python" scripts/watch/plot_runs.py "$out/train_fsdp.jsonl" "$out/train_ddp.jsonl" --names FSDP DDP -o "$out/losses.png" ||
  echo "(no plot: $python cannot draw it)"
