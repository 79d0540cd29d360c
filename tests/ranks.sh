# Shared by the multi-process test scripts (sourced): real ranks with torchrun's variables over
# loopback, on the debug model narrowed to dim 128 (a quarter of dim 256's time, most of which was
# Newton-Schulz), at 64 tokens. Expects $train (the program), $config and $work.
#
# Newton-Schulz in fp32: these tests are not about its precision, and bf16 matrix products on a
# CPU without native bf16 instructions (AVX2 only) run about 75 times slower than fp32 ones.
# 24 sequences per step divide over 1, 2, 3 and 4 ranks.
dim=128
common=(--config "$config" --runtime.device cpu --runtime.num_threads 1 --model.dim $dim --data.seq_length 64
        --optim.optim.ns_dtype float32
        --optim.batch_size 24 --train.micro_bs 2 --optim.warmup_steps 2 --optim.total_steps 8)

# run_ranks W LOGPREFIX ARGS...: W processes in the background, rank r logging to LOGPREFIX.r.
# With limit_rank=R and limit_kb=K set, rank R runs under `ulimit -f K` (files of at most K KiB:
# a disk that fills up, as the process sees it).
pids=()
run_ranks() {
  local w=$1 log=$2; shift 2
  # A port the kernel has just handed out free (a random one could be another test's store).
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  pids=()
  for r in $(seq 0 $((w - 1))); do
    (
      [ "${limit_rank:-}" = "$r" ] && ulimit -f "$limit_kb"
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r LOCAL_RANK=$r WORLD_SIZE=$w \
        exec "$train" "${common[@]}" "$@"
    ) >"$log.$r" 2>&1 &
    pids+=($!)
  done
}
# wait_ranks: 0 when every rank exited 0. wait_codes: sets $codes to each rank's exit code,
# space-separated (not in a subshell: only this shell can wait for its children).
wait_ranks() { local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; return $rc; }
wait_codes() { codes=""; for p in "${pids[@]}"; do wait "$p"; codes+="$? "; done; }
# compare_losses A.jsonl B.jsonl RTOL LABEL [FIRST LAST]: steps FIRST-LAST (default 5-8) of B
# against A (RTOL 0: bit-identical); the last record of a step counts.
compare_losses() {
  python3 - "$@" <<'PY'
import json, sys
a = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1]))}
b = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[2]))}
rtol = float(sys.argv[3])
first, last = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (5, 8)
steps = range(first, last + 1)
worst = max(abs(b[s] - a[s]) / abs(a[s]) for s in steps)
print(f"{sys.argv[4]}: steps {first}-{last} {[b[s] for s in steps]}, largest relative difference {worst:.2e} (allowed {rtol:g})")
sys.exit(0 if worst <= rtol else 1)
PY
}
fail() { echo "FAIL: $*"; for f in "$work"/*.log.*; do echo "== $f"; tail -5 "$f"; done; exit 1; }
