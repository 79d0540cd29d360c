#!/usr/bin/env bash
# What a restructuring must leave unchanged, written to OUT_DIR for `diff -r` against another
# build: twenty steps of the debug preset on ten layouts (each step's loss, gradient norm and
# communication bytes by group), and what --print-plan and --dry-run print.
#   scripts/perf/behaviour_fingerprint.sh OUT_DIR [BUILD_DIR]
# Runs on the CPU with loopback Gloo; a few minutes on 2 cores.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=$1
build=${2:-$ROOT/build}
python=$ROOT/.venv/bin/python
train=$build/apps/train_fsdp
config=$ROOT/configs/debug/normal.toml
mkdir -p "$out"
# Sequences of 256 tokens and Newton-Schulz in fp32 (bf16 products are very slow on CPUs without
# bf16 instructions): seconds per run rather than minutes.
common=(--config "$config" --runtime.device cpu --runtime.num_threads 1 --optim.total_steps 20
        --data.seq_length 256 --train.micro_bs 2 --optim.optim.ns_dtype float32)

# The numbers of a metrics file, without times, dates and paths: one line per step.
numbers() {
  "$python" - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    keep = {k: v for k, v in r.items()
            if k in ("step", "loss", "grad_norm", "replica_losses", "outer") or k.startswith("comm_bytes")}
    if isinstance(keep.get("outer"), dict):
        keep["outer"] = {k: v for k, v in keep["outer"].items() if "second" not in k}
    print(json.dumps(keep, sort_keys=True))
PY
}

run() {  # NAME RANKS PROGRAM ARGS...
  local name=$1 ranks=$2 program=$3
  shift 3
  local metrics=$out/$name.jsonl.raw
  rm -f "$metrics"
  if [ "$ranks" = 1 ]; then
    "$build/apps/$program" "${common[@]}" --logging.metrics_file "$metrics" "$@" >"$out/$name.log" 2>&1
  else
    local port
    port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$ROOT/.venv/bin/torchrun" --nproc_per_node "$ranks" --master_port "$port" --no-python \
      "$build/apps/$program" "${common[@]}" --logging.metrics_file "$metrics" "$@" >"$out/$name.log" 2>&1
  fi
  numbers "$metrics" >"$out/$name.steps"
  rm -f "$metrics"
  echo "$name: $(tail -1 "$out/$name.steps" | cut -c1-120)"
}

run single 1 train_fsdp
run fsdp2 2 train_fsdp
run hsdp2x2 4 train_fsdp --parallel.dp_replicate 2
run tp2_fsdp2 4 train_fsdp --parallel.tp 2
run diloco2x2 4 train_fsdp --parallel.dp_replicate 2 --diloco.inner_steps 5
run ddp2 2 train_ddp
run cp2_fsdp2 4 train_fsdp --parallel.cp 2
run cp2_ring 2 train_fsdp --parallel.cp 2 --parallel.cp_rotate ring
run float8_emulated 1 train_fsdp --float8.enable_float8_linear true --float8.emulate true
run fsdp2_ac 2 train_fsdp --train.ac_ckpt true

# Plans and dry runs of every layout above, and of the presets on eight GPUs.
plan() {  # NAME PROGRAM ARGS...
  local name=$1 program=$2
  shift 2
  "$build/apps/$program" "$@" >"$out/$name" 2>&1 || echo "exit $?" >>"$out/$name"
}
small=(--config "$config" --train.micro_bs 2)
plan plan_fsdp2 train_fsdp "${small[@]}" --print-plan --world-size 2
plan plan_rank1_hsdp train_fsdp "${small[@]}" --print-plan=1 --world-size 4 --parallel.dp_replicate 2
plan plan_tp train_fsdp "${small[@]}" --print-plan=3 --world-size 4 --parallel.tp 2
plan plan_diloco train_fsdp "${small[@]}" --print-plan --world-size 4 --parallel.dp_replicate 2 --diloco.inner_steps 5
plan plan_ddp train_ddp "${small[@]}" --print-plan --world-size 2
for preset in 1B 7B; do
  plan "dry_run_$preset" train_fsdp --config "$ROOT/configs/$preset/H100.toml" --dry-run --world-size 8 --device cuda \
    --runtime.device_memory_gb 80
done
plan dry_run_debug train_fsdp --config "$config" --dry-run
# Log lines carry a time stamp: compare their text only.
sed -i -E 's/^[0-9:.]+ //' "$out"/dry_run_*
echo "written to $out"
