#!/usr/bin/env bash
# DiLoCo's trade on the CPU at small scale (issue 29): the debug model on the embedded corpus
# (configs/debug/convergence.toml), the same global batch and data for every run, 4 processes:
#
#   ddp              train_ddp: every step's gradients averaged over the 4 ranks (synchronous)
#   h10, h50         4 replicas of 1 rank, an outer step every 10 / 50 steps, Muon inner steps
#   h10_average      h10 with outer lr 1 and no momentum: plain averaging every 10 steps
#   h10_uint8        h10 with the pseudo-gradients sent as 8-bit codes
#   h10_adamw        h10 with AdamW inner steps for the hidden matrices too
#   h10_streaming    h10 in 2 fragments, each exchange applied a step after it starts
#   one_replica      1 process on a quarter of the batch: one replica alone
#
# then a table (final train and validation loss, bytes across replicas per step) and one plot of
# the loss curves (scripts/perf/diloco_report.py).
#
#   scripts/perf/diloco_bench.sh [STEPS] [extra train arguments...]      (default 300 steps)
#   OUT=dir ONLY="h10 h50" scripts/perf/diloco_bench.sh                   # some runs only
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
steps=${1:-300}
shift $(( $# > 0 ? 1 : 0 ))
cd "$ROOT"
"$ROOT/scripts/build.sh" >/dev/null
out=${OUT:-outputs/diloco-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out/bin"
# The programs copied: a rebuild during the runs cannot touch them.
cp build/apps/train_fsdp build/apps/train_ddp "$out/bin/"
config=(--config configs/debug/convergence.toml --optim.total_steps "$steps" --runtime.num_threads 1
        --data.eval_interval 50 --logging.interval 50)
declare -A runs=(
  [ddp]="train_ddp 4"
  [h10]="train_fsdp 4 --parallel.dp_replicate 4 --diloco.inner_steps 10"
  [h10_average]="train_fsdp 4 --parallel.dp_replicate 4 --diloco.inner_steps 10 --diloco.outer_lr 1 --diloco.outer_momentum 0"
  [h50]="train_fsdp 4 --parallel.dp_replicate 4 --diloco.inner_steps 50"
  [h10_uint8]="train_fsdp 4 --parallel.dp_replicate 4 --diloco.inner_steps 10 --diloco.compression uint8"
  [h10_adamw]="train_fsdp 4 --parallel.dp_replicate 4 --diloco.inner_steps 10 --optim.optim.type adamw --optim.optim.lr 0.003"
  [h10_streaming]="train_fsdp 4 --parallel.dp_replicate 4 --diloco.inner_steps 10 --diloco.fragments 2 --diloco.fragment_delay 1"
  [one_replica]="train_fsdp 1 --optim.batch_size 4"
)
order=(ddp h10 h10_average h50 h10_uint8 h10_adamw h10_streaming one_replica)
for name in ${ONLY:-${order[@]}}; do
  read -r program nproc args <<<"${runs[$name]}"
  echo "== $name: $program on $nproc process(es) $args"
  start=$(date +%s)
  # shellcheck disable=SC2086  # args holds several words
  .venv/bin/torchrun --standalone --nproc_per_node="$nproc" --no-python "$out/bin/$program" "${config[@]}" \
    --logging.metrics_file "$out/$name.jsonl" $args "$@" >"$out/$name.log" 2>&1 \
    || { tail -20 "$out/$name.log"; echo "FAIL: $name"; exit 1; }
  echo "   $(( $(date +%s) - start )) s; $(grep -E 'step [0-9]+/[0-9]+ \| val_loss' "$out/$name.log" | tail -1 | sed 's/.*| //')"
done
.venv/bin/python scripts/perf/diloco_report.py "$out" ${ONLY:-${order[@]}}
