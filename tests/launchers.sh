#!/usr/bin/env bash
# End-to-end runs of train_fsdp: one process, real launchers and real failures.
#   launchers.sh single_process|torchrun|mpirun|hsdp_torchrun|killed_rank|hung_rank| \
#                world_size_mismatch|unreachable_master \
#                TRAIN_FSDP CONFIG PYTHON_BIN_DIR
# CONFIG is the debug preset (configs/debug/normal.toml: 4 steps, fake data, vocabulary 1024).
set -u
what=$1 train=$2 config=$3 bindir=$4
# A port the kernel has just handed out free (a random one could be another test's store).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A later --logging.metrics_file overrides this one. Newton-Schulz in fp32: bf16 matrix products
# on a CPU without native bf16 instructions (AVX2 only) run about 75 times slower, and these tests
# are about launching, not precision.
common=(--config "$config" --runtime.device cpu --runtime.num_threads 1 --logging.metrics_file /dev/null
        --optim.optim.ns_dtype float32)

# The metrics file of a finished run of the preset: one record per step 1..4, finite losses.
check_run() {
  "$bindir/python" - "$1" <<'PY'
import json, math, sys
records = [json.loads(l) for l in open(sys.argv[1])]
steps, losses = [r["step"] for r in records], [r["loss"] for r in records]
print("steps", steps, "losses", losses)
assert steps == [1, 2, 3, 4], f"steps {steps}, expected 1..4"
assert all(math.isfinite(x) for x in losses), f"losses {losses}"
# Every record names the attention kernel that ran: the preset's documents on the CPU go through
# scaled_dot_product_attention with a mask, whose CPU kernels are flash's or the unfused one.
kernels = {r.get("attention_kernel") for r in records}
print("attention kernels", kernels)
assert len(kernels) == 1 and kernels <= {"flash_attention", "math"}, f"attention_kernel {kernels}"
PY
}

# past_start_up LOG: waits until rank 0 has logged step 2, both ranks past their start-up (which a
# busy machine can stretch to tens of seconds), or fails.
past_start_up() {
  for _ in $(seq 600); do grep -q "step 2/" "$1" && return 0; sleep 0.2; done
  cat "$1"; echo "FAIL: rank 0 never reached step 2"; exit 1
}

case $what in
hsdp_torchrun)
  # train_hsdp on two "nodes" of two ranks: two torchrun agents on loopback, started as two
  # machines would start them (static rendezvous at node 0's address). Shard groups are the
  # nodes, replicas across them; the run must equal one process on the same global batches.
  hsdp=$(dirname "$train")/train_hsdp
  small=(--data.seq_length 128 --optim.batch_size 8 --train.micro_bs 2)
  "$train" "${common[@]}" "${small[@]}" --logging.metrics_file "$tmp/single.jsonl" >"$tmp/single.log" 2>&1 \
    || { cat "$tmp/single.log"; echo "FAIL: the single process"; exit 1; }
  for node in 0 1; do
    "$bindir/torchrun" --nnodes 2 --node_rank $node --nproc_per_node 2 --master_addr 127.0.0.1 \
      --master_port "$port" --no-python "$hsdp" "${common[@]}" "${small[@]}" \
      --logging.metrics_file "$tmp/hsdp.jsonl" >"$tmp/node$node.log" 2>&1 &
    pids[$node]=$!
  done
  wait "${pids[0]}"; rc0=$?
  wait "${pids[1]}"; rc1=$?
  cat "$tmp/node0.log" | grep -v "^W[0-9]" | grep -E "hybrid|world:|step 4/4|error" | head
  [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || { tail -20 "$tmp/node0.log" "$tmp/node1.log"; echo "FAIL: exit codes $rc0 $rc1"; exit 1; }
  grep -q "hybrid sharding: parameters sharded over groups of 2 consecutive ranks, replicated 2 times" "$tmp/node0.log" \
    || { echo "FAIL: not sharded by node"; exit 1; }
  "$bindir/python" - "$tmp/single.jsonl" "$tmp/hsdp.jsonl" <<'PY' || { echo "FAIL: losses differ"; exit 1; }
import json, sys
one, hsdp = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert len(one) == len(hsdp) == 4, (one, hsdp)
for step, (a, b) in enumerate(zip(one, hsdp), 1):
    print(f"step {step}: loss {a!r} on 1 process, {b!r} under HSDP 2x2, relative difference {abs(a - b) / abs(a):.1e}")
    assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {a} vs {b}"
# Bytes by group: the gathers, reduce-scatters and Muon's exchange stay inside the shard group
# (a node); only the all-reduce of the reduced rows crosses to the other replica. The step's
# totals hold both plus the world's own all-reduce (the loss with the loop's flags).
r = json.loads(open(sys.argv[2]).readlines()[-1])
shard, rep, total = r["comm_bytes_shard_group"], r["comm_bytes_replicate_group"], r["comm_bytes"]
print("by group:", shard, rep)
assert shard["all_gather"] > 0 and shard["reduce_scatter"] > 0 and shard["all_to_all"] > 0
assert rep["all_reduce"] > 0 and rep["all_gather"] == rep["reduce_scatter"] == rep["all_to_all"] == 0
# What crosses is each unit's reduced rows n (fp32): all-reduced over R = 2 replicas, 4(R-1)/R n
# = 2n, as much as the reduce-scatter that made them over S = 2 ranks counted (2(S-1) n); and
# Muon's results shared between the replicas (exact counts: test scale.bytes_match_measured).
assert rep["all_reduce"] > shard["reduce_scatter"], (rep, shard)
for k in total:
    assert total[k] >= shard[k] + rep[k], k
assert total["all_gather"] == shard["all_gather"] and total["reduce_scatter"] == shard["reduce_scatter"]
PY
  # One node has nothing to replicate across.
  out=$("$bindir/torchrun" --standalone --nproc_per_node 2 --no-python "$hsdp" "${common[@]}" "${small[@]}" 2>&1)
  echo "$out" | grep -q "all 2 rank(s) are on one node (LOCAL_WORLD_SIZE = WORLD_SIZE = 2): use train_fsdp" \
    || { echo "$out" | tail -5; echo "FAIL: one node was not refused"; exit 1; }
  ;;
single_process)
  # The preset trains on one process, as a user runs it (the cli.debug_preset_trains test).
  "$train" "${common[@]}" --logging.metrics_file "$tmp/metrics.jsonl"
  rc=$?
  [ $rc -eq 0 ] || { echo "FAIL: exited $rc"; exit 1; }
  check_run "$tmp/metrics.jsonl" || { echo "FAIL: metrics"; exit 1; }
  "$bindir/python" - "$tmp/metrics.jsonl" <<'PY' || { echo "FAIL: first loss"; exit 1; }
import json, math, sys
first = json.loads(open(sys.argv[1]).readline())["loss"]
# Fake data are uniform random tokens over the vocabulary of 1024, so no model does better than
# ln 1024 = 6.93 in expectation; at initialisation the logits are random with a spread of about
# one (the output layer's std is dim^-0.5), which costs about half of that squared more (7.42
# with the preset's seed). A loss outside [ln 1024 - 0.5, ln 1024 + 1.5] means the model, the
# data or the loss is off, not noise: 16 sequences of 1024 tokens make the sample mean's own
# noise about 0.01.
lo, hi = math.log(1024) - 0.5, math.log(1024) + 1.5
print(f"loss at step 1: {first:.4f}, expected in [{lo:.2f}, {hi:.2f}]")
assert lo <= first <= hi
PY
  ;;
torchrun|mpirun)
  # Rows of 256 tokens rather than the preset's 1024: what is checked is the launch and the
  # equality of the two runs, not the preset's size (a quarter of the time).
  common+=(--data.seq_length 256)
  "$train" "${common[@]}" --logging.metrics_file "$tmp/single.jsonl" >"$tmp/single.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { cat "$tmp/single.log"; echo "FAIL: the single process exited $rc"; exit 1; }
  metrics=$tmp/two.jsonl  # written by rank 0
  if [ "$what" = torchrun ]; then
    out=$("$bindir/torchrun" --standalone --nproc_per_node=2 --no-python "$train" "${common[@]}" \
          --logging.metrics_file "$metrics" 2>&1)
  else
    out=$(mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$port \
          "$train" "${common[@]}" --logging.metrics_file "$metrics" 2>&1)
  fi
  rc=$?
  echo "$out"
  [ $rc -eq 0 ] || { echo "FAIL: $what exited $rc"; exit 1; }
  echo "$out" | grep -q "world: 2 process(es) via" || { echo "FAIL: not 2 ranks"; exit 1; }
  check_run "$tmp/single.jsonl" && check_run "$metrics" || { echo "FAIL: metrics"; exit 1; }
  # The same global batch, data and initialisation in fp32 on one process (2 micro-batches of 8)
  # and on two (one each): at most the order of summation differs (gradients and loss summed over
  # ranks instead of accumulated, norms summed by shard). On CPU with Gloo the losses at full
  # precision come out bit for bit equal today; the bound does not rely on that. A reordered fp32
  # sum differs by ~1e-7 relative, and 3 optimizer steps can amplify that; 1e-5 relative (7e-5
  # at a loss of 7.4) allows it, while a real fault (a lost or doubled micro-batch changes step 1
  # by ~0.01, the sampling noise of 8 x 256 tokens) is far above it.
  "$bindir/python" - "$tmp/single.jsonl" "$metrics" <<'PY' || { echo "FAIL: losses differ"; exit 1; }
import json, sys
one, two = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
for step, (a, b) in enumerate(zip(one, two), 1):
    print(f"step {step}: loss {a!r} on 1 process, {b!r} on 2, relative difference {abs(a - b) / abs(a):.1e}")
    assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {a} vs {b}"
PY
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
  past_start_up "$log0"
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
hung_rank)
  # Rank 1 stops (SIGSTOP) after its first steps and never answers: rank 0 must exit non-zero
  # within runtime.timeout_s plus a little, naming the step that stalled (the watchdog's path, the
  # one NCCL runs depend on: their waits do not block the host). Rank 1, once resumed, finds its
  # own limit long passed and exits non-zero too.
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2
  log0=$tmp/hung0.log log1=$tmp/hung1.log
  RANK=0 LOCAL_RANK=0 "$train" "${common[@]}" --optim.total_steps 100000 --runtime.timeout_s 8 >"$log0" 2>&1 &
  pid0=$!
  RANK=1 LOCAL_RANK=1 "$train" "${common[@]}" --optim.total_steps 100000 --runtime.timeout_s 8 >"$log1" 2>&1 &
  pid1=$!
  past_start_up "$log0"
  kill -STOP $pid1
  start=$(date +%s)
  wait $pid0; rc0=$?
  took=$(( $(date +%s) - start ))
  kill -CONT $pid1
  wait $pid1; rc1=$?
  cat "$log0" "$log1"
  echo "rank 0 exited $rc0, ${took}s after rank 1 stopped; rank 1 exited $rc1 once resumed"
  [ $rc0 -eq 1 ] && [ $rc1 -ne 0 ] || { echo "FAIL: exit codes $rc0 $rc1"; exit 1; }
  [ $took -le 20 ] || { echo "FAIL: took longer than the timeout and a margin"; exit 1; }
  grep -qE "rank 0 failed in step [0-9]+: no collective with the other ranks completed for [0-9]+ s \(runtime.timeout_s = 8\)" "$log0" \
    || { echo "FAIL: no clear message on rank 0"; exit 1; }
  grep -q "rank 1 failed in step" "$log1" || { echo "FAIL: no clear message on rank 1"; exit 1; }
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
