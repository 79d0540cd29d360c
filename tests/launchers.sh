#!/usr/bin/env bash
# End-to-end runs of train_fsdp with real launchers and real failures.
#   launchers.sh torchrun|mpirun|killed_rank|world_size_mismatch TRAIN_FSDP CONFIG PYTHON_BIN_DIR
set -u
what=$1 train=$2 config=$3 bindir=$4
port=$((20000 + RANDOM % 30000))
common=(--config "$config" --runtime.device cpu --runtime.num_threads 1 --logging.metrics_file /dev/null)
final_loss() { grep -o 'step [0-9]*/[0-9]* | loss [0-9.]*' | tail -1 | awk '{print $NF}'; }

case $what in
torchrun|mpirun)
  single=$("$train" "${common[@]}" 2>&1 | final_loss)
  if [ "$what" = torchrun ]; then
    metrics=$(mktemp)
    out=$("$bindir/torchrun" --standalone --nproc_per_node=2 --no-python "$train" "${common[@]}" \
          --logging.metrics_file "$metrics" 2>&1)
  else
    out=$(mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$port \
          "$train" "${common[@]}" 2>&1)
  fi
  rc=$?
  echo "$out"
  two=$(echo "$out" | final_loss)
  echo "final loss: 1 process $single, 2 processes via $what $two"
  [ $rc -eq 0 ] || { echo "FAIL: $what exited $rc"; exit 1; }
  echo "$out" | grep -q "world: 2 process(es) via" || { echo "FAIL: not 2 ranks"; exit 1; }
  # The same global batch and fp32 arithmetic: the printed losses (4 decimals) agree.
  [ -n "$single" ] && [ "$single" = "$two" ] || { echo "FAIL: losses differ"; exit 1; }
  if [ "$what" = torchrun ]; then
    # The metrics record what moved and where the time went.
    "$bindir/python" - "$metrics" <<'PY' || { echo "FAIL: metrics"; exit 1; }
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
print("last metrics record:", {k: r[k] for k in ("comm_bytes", "comm_wait_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds")})
assert r["comm_bytes"]["all_gather"] > 0 and r["comm_bytes"]["reduce_scatter"] > 0 and r["comm_bytes"]["all_to_all"] > 0
assert all(r[k] > 0 for k in ("forward_seconds", "backward_seconds", "optimizer_seconds"))
PY
  fi
  ;;
killed_rank)
  # Two ranks on a long run; rank 1 is killed with SIGKILL after its first steps. Rank 0 must
  # exit non-zero with a clear message well within the timeout.
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2
  log0=$(mktemp) log1=$(mktemp)
  RANK=0 LOCAL_RANK=0 "$train" "${common[@]}" --optim.total_steps 100000 --runtime.timeout_s 30 >"$log0" 2>&1 &
  pid0=$!
  RANK=1 LOCAL_RANK=1 "$train" "${common[@]}" --optim.total_steps 100000 --runtime.timeout_s 30 >"$log1" 2>&1 &
  pid1=$!
  for _ in $(seq 100); do grep -q "step 2/" "$log0" && break; sleep 0.2; done
  kill -9 $pid1
  start=$(date +%s)
  wait $pid0; rc=$?
  took=$(( $(date +%s) - start ))
  cat "$log0"
  echo "rank 0 exited $rc, ${took}s after rank 1 was killed"
  [ $rc -ne 0 ] || { echo "FAIL: rank 0 exited 0"; exit 1; }
  [ $took -le 40 ] || { echo "FAIL: took longer than the timeout"; exit 1; }
  grep -q "rank 0 failed in step" "$log0" || { echo "FAIL: no clear message"; exit 1; }
  ;;
world_size_mismatch)
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port
  log0=$(mktemp) log1=$(mktemp)
  # batch 48 / micro_bs 8 divides by 2 and 3 ranks, so both pass config validation.
  RANK=0 WORLD_SIZE=2 "$train" "${common[@]}" --optim.batch_size 48 --runtime.timeout_s 20 >"$log0" 2>&1 &
  pid0=$!
  RANK=1 WORLD_SIZE=3 "$train" "${common[@]}" --optim.batch_size 48 --runtime.timeout_s 20 >"$log1" 2>&1 &
  pid1=$!
  wait $pid0; rc0=$?
  wait $pid1; rc1=$?
  cat "$log0" "$log1"
  [ $rc0 -ne 0 ] && [ $rc1 -ne 0 ] || { echo "FAIL: exit codes $rc0 $rc1"; exit 1; }
  grep -q "launched with world size 2 but rank 1 with 3" "$log0" || { echo "FAIL: rank 0 message"; exit 1; }
  grep -q "launched with world size 3 but rank 0 with 2" "$log1" || { echo "FAIL: rank 1 message"; exit 1; }
  ;;
unreachable_master)
  # Rank 1 of 2 with nobody serving the rendezvous: a clear error once runtime.timeout_s passes.
  start=$(date +%s)
  out=$(MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=1 WORLD_SIZE=2 "$train" "${common[@]}" --runtime.timeout_s 5 2>&1)
  rc=$?
  took=$(( $(date +%s) - start ))
  echo "$out"
  echo "exited $rc after ${took}s"
  [ $rc -ne 0 ] && [ $took -le 30 ] || { echo "FAIL"; exit 1; }
  echo "$out" | grep -q "rendezvous at 127.0.0.1:$port failed within 5 s" || { echo "FAIL: message"; exit 1; }
  ;;
esac
echo PASS
