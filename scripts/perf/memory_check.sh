#!/usr/bin/env bash
# The memory estimate (train_fsdp --dry-run) against the measured peak of live tensor bytes
# (ZB_COUNT_TENSOR_MEMORY=1: a counting CPU allocator) on real CPU runs, one table row per
# model x ranks x activation checkpointing. Prints a markdown table and writes OUT/memory_check.json.
#
#   scripts/perf/memory_check.sh                     # debug, 70M and 150M on 1, 2, 4 ranks, AC off/on
#   MODELS="debug" RANKS="1 2" scripts/perf/memory_check.sh
#   MAX_ERROR=10 ...                            # exit 1 when a row's |error| exceeds 10% (the test)
#   EXTRA="--diloco.inner_steps 1 --parallel.dp_replicate 2" ...   # more arguments for every run
#   RANKS=4 EXTRA="--parallel.tp 2" ACS=true ...   # TP 2 x FSDP 2, activation checkpointing on only
#
# Shapes: the debug preset as it is (8 x 1024 tokens per micro-batch); 70M and 150M (from the
# 150M preset) at 2 x 256 tokens per micro-batch; two micro-batches per rank per step (so the
# gradient accumulators count), 2 steps (so the optimizer state exists), fp32, Newton-Schulz in
# fp32. Environment: OUT, MODELS, RANKS, ACS (default "false true"), MAX_ERROR, PYTHON (default .venv/bin/python), TRAIN_FSDP.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
train=${TRAIN_FSDP:-build/apps/train_fsdp}
python=${PYTHON:-.venv/bin/python}
out=${OUT:-outputs/memory-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
rows=$out/rows.jsonl
: >"$rows"

# W ranks of a program on this machine with torchrun's variables (torchrun itself would add a
# Python start with torch, two seconds of CPU a run); fails when a rank does, stopping the others.
run_ranks() {
  local world=$1 port pids=() r
  shift
  # Below the ephemeral range, as tests/e2e/conftest.py's free_port (a connection cannot take it first).
  port=$("$python" -c '
import random, socket
while True:
    p = random.randrange(20000, 32768)
    try:
        socket.socket().bind(("127.0.0.1", p))
        print(p)
        break
    except OSError:
        pass')
  for ((r = 0; r < world; r++)); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r LOCAL_RANK=$r WORLD_SIZE=$world LOCAL_WORLD_SIZE=$world "$@" &
    pids+=($!)
  done
  for ((r = 0; r < world; r++)); do
    wait -n "${pids[@]}" || { kill "${pids[@]}" 2>/dev/null; wait; return 1; }
  done
}

for model in ${MODELS:-debug 70M 150M}; do
  for W in ${RANKS:-1 2 4}; do
    for ac in ${ACS:-false true}; do
      case $model in
        debug) shape=(--config configs/debug/normal.toml --train.micro_bs 8 --optim.batch_size $((W * 16))) ;;
        *) shape=(--config configs/150M/H100.toml --name_model "$model" --data.seq_length 256 --train.micro_bs 2
                  --optim.batch_size $((W * 4))) ;;
      esac
      args=("${shape[@]}" --wandb false --train.ac_ckpt "$ac" --data.fake --runtime.device cpu --optim.optim.ns_dtype float32
            --ckpt.path "" --data.eval_interval 0 --optim.total_steps 2 --optim.warmup_steps 1 ${EXTRA:-})
      predicted=$(RANK=0 WORLD_SIZE=1 "$train" "${args[@]}" --dry-run --world-size "$W" 2>&1 |
                  sed -n 's/.*(\([0-9]*\) bytes), at the \(.*\)/\1\t\2/p')
      metrics=$out/$model-$W-$ac.jsonl
      ZB_COUNT_TENSOR_MEMORY=1 run_ranks "$W" "$train" "${args[@]}" --runtime.num_threads 1 --logging.metrics_file "$metrics" \
        >"$out/$model-$W-$ac.log" 2>&1 || { echo "FAILED: $out/$model-$W-$ac.log"; tail -5 "$out/$model-$W-$ac.log"; exit 1; }
      "$python" - "$model" "$W" "$ac" "$predicted" "$metrics" >>"$rows" <<'PY'
import json, sys
model, W, ac, predicted, metrics = sys.argv[1:]
bytes_, where = predicted.split("\t")
measured = max(json.loads(l)["peak_memory_bytes"] for l in open(metrics))
print(json.dumps({"model": model, "ranks": int(W), "ac_ckpt": ac == "true", "predicted_bytes": int(bytes_),
                  "measured_bytes": measured, "error": int(bytes_) / measured - 1, "predicted_peak_at": where}))
PY
      tail -1 "$rows"
    done
  done
done

"$python" - "$rows" "$out/memory_check.json" ${MAX_ERROR:+"$MAX_ERROR"} <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
json.dump(rows, open(sys.argv[2], "w"), indent=1)
print("\n| model | ranks | AC | predicted MiB | measured MiB | error | predicted peak at |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['model']} | {r['ranks']} | {'on' if r['ac_ckpt'] else 'off'} | {r['predicted_bytes'] / 2**20:.1f} | "
          f"{r['measured_bytes'] / 2**20:.1f} | {100 * r['error']:+.1f}% | {r['predicted_peak_at']} |")
largest = 100 * max(abs(r['error']) for r in rows)
print(f"\nlargest error: {largest:.1f}%")
limit = float(sys.argv[3]) if len(sys.argv) > 3 else None
if limit is not None:
    print("PASS" if largest <= limit else f"FAIL: an error above {limit}%")
    sys.exit(0 if largest <= limit else 1)
PY
