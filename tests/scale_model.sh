#!/usr/bin/env bash
# The step plan's bytes (train_fsdp --print-plan, read by scripts/perf/scale_model.py) against what
# real runs measure, on 4 Gloo ranks over loopback: FSDP over 4, HSDP 2x2 and 1x4 (Muon split over
# the replicas) and train_ddp on 4 (rank 0's record, every kind of collective, by group under
# HSDP), DiLoCo 2x2 with an outer step every step (the inner step's bytes plus the outer
# step's) and TP 2 x FSDP 2 (Muon, by group: shard and TP). They must be equal, not close.
#   scale_model.sh TRAIN_FSDP CONFIG PYTHON
set -u
train=$1 config=$2 python=$3
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
train_fsdp=$train train_ddp="$(dirname "$train")/train_ddp"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/ranks.sh"
short=(--optim.total_steps 2 --wandb false)
for layout in fsdp hsdp hsdp1x4 ddp diloco tp; do
  extra=()
  train=$train_fsdp
  [ $layout = hsdp ] && extra=(--parallel.dp_shard 2 --parallel.dp_replicate 2)
  [ $layout = hsdp1x4 ] && extra=(--parallel.dp_shard 1 --parallel.dp_replicate 4)
  [ $layout = diloco ] && extra=(--parallel.dp_shard 2 --parallel.dp_replicate 2 --diloco.inner_steps 1)
  [ $layout = tp ] && extra=(--parallel.tp 2)
  [ $layout = ddp ] && train=$train_ddp
  run_ranks 4 "$work/$layout.log" "${short[@]}" "${extra[@]}" --logging.metrics_file "$work/$layout.jsonl"
  wait_ranks || fail "$layout run"
  args=(--bytes --world 4)
  [ $layout = hsdp ] && args+=(--shard 2)
  [ $layout = diloco ] && args+=(--shard 2)
  [ $layout = hsdp1x4 ] && args+=(--shard 1)
  [ $layout = ddp ] && args+=(--ddp)
  [ $layout = tp ] && args+=(--tp 2)
  "$python" "$root/scripts/perf/scale_model.py" --train "$train_fsdp" --config "$config" "${args[@]}" \
    -- "${common[@]:2}" "${short[@]}" $([ $layout = diloco ] && echo --diloco.inner_steps 1) \
    > "$work/$layout.model.json" || fail "scale_model $layout"
  "$python" - "$work/$layout.model.json" "$work/$layout.jsonl" "$layout" <<'PY' || fail "$layout bytes differ"
import json, sys
model = json.load(open(sys.argv[1]))
record = [json.loads(l) for l in open(sys.argv[2])][-1]
pairs = [("total", "comm_bytes")]
if sys.argv[3].startswith("hsdp") or sys.argv[3] == "diloco":
    pairs += [("shard", "comm_bytes_shard_group"), ("replicate", "comm_bytes_replicate_group")]
if sys.argv[3] == "tp":
    pairs += [("shard", "comm_bytes_shard_group"), ("tp", "comm_bytes_tp_group")]
if "diloco" in model:  # every step an outer step: its bytes on top of the inner step's
    for group, kinds in model["diloco"]["outer_step"].items():
        for name in (group, "total"):
            for kind, b in kinds.items():
                model.setdefault(name, {})[kind] = model.get(name, {}).get(kind, 0) + b
bad = 0
for ours, theirs in pairs:
    measured = {k: v for k, v in record[theirs].items() if v}
    predicted = {k: v for k, v in model.get(ours, {}).items() if v}
    print(f"{sys.argv[3]} {ours}: measured {measured}, model {predicted}")
    bad += measured != predicted
sys.exit(1 if bad else 0)
PY
done
echo PASS
