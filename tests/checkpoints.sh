#!/usr/bin/env bash
# Checkpoints end to end with real processes:
#   checkpoints.sh exact_resume|other_world_size|signal|kill_during_save|bad_checkpoint|hf_export|hf_roundtrip
#                  TRAIN_FSDP CONFIG PYTHON
set -u
what=$1 train=$2 config=$3 python=${4:-python3}
export_hf="$(dirname "$train")/export_hf"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The debug model at 64 tokens; 24 sequences per step divide over 1, 2, 3 and 4 ranks.
common=(--config "$config" --runtime.device cpu --runtime.num_threads 1 --data.seq_length 64
        --optim.batch_size 24 --train.micro_bs 2 --optim.warmup_steps 2 --optim.total_steps 8)

# run_ranks W LOGPREFIX ARGS...: W processes with torchrun's variables, in the background.
pids=()
run_ranks() {
  local w=$1 log=$2; shift 2
  local port=$((20000 + RANDOM % 30000))
  pids=()
  for r in $(seq 0 $((w - 1))); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r LOCAL_RANK=$r WORLD_SIZE=$w \
      "$train" "${common[@]}" "$@" >"$log.$r" 2>&1 &
    pids+=($!)
  done
}
wait_ranks() { local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; return $rc; }
losses() { python3 -c "import json,sys; print(' '.join(repr(json.loads(l)['loss']) for l in open(sys.argv[1]) if json.loads(l)['step'] > 4))" "$1"; }
fail() { echo "FAIL: $*"; for f in "$work"/*.log.*; do echo "== $f"; tail -5 "$f"; done; exit 1; }

case $what in
exact_resume)
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --ckpt.interval 4 --ckpt.keep 0 --logging.metrics_file "$work/a.jsonl"
  wait_ranks || fail "straight run"
  run_ranks 2 "$work/b.log" --ckpt.path "$work/b" --ckpt.resume "$work/a/step_00000004" --logging.metrics_file "$work/b.jsonl"
  wait_ranks || fail "resumed run"
  a=$(losses "$work/a.jsonl"); b=$(losses "$work/b.jsonl")
  echo "steps 5-8 straight: $a"; echo "steps 5-8 resumed:  $b"
  [ -n "$a" ] && [ "$a" = "$b" ] || fail "losses differ"
  ;;
other_world_size)
  run_ranks 4 "$work/a.log" --ckpt.path "$work/a" --ckpt.interval 4 --ckpt.keep 0 --logging.metrics_file "$work/a.jsonl"
  wait_ranks || fail "4-rank run"
  for w in 2 3; do
    run_ranks $w "$work/r$w.log" --ckpt.path "$work/r$w" --ckpt.resume "$work/a/step_00000004" \
      --logging.metrics_file "$work/r$w.jsonl"
    wait_ranks || fail "resume on $w ranks"
    python3 - "$work/a.jsonl" "$work/r$w.jsonl" $w <<'PY' || fail "losses on $w ranks"
import json, sys
a = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1]))}
b = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[2]))}
worst = max(abs(b[s] - a[s]) / abs(a[s]) for s in range(5, 9))
print(f"saved on 4 ranks, resumed on {sys.argv[3]}: steps 5-8 {[round(b[s], 6) for s in range(5, 9)]}, "
      f"largest relative difference from the 4-rank run {worst:.2e}")
sys.exit(0 if worst <= 1e-4 else 1)  # fp32, different summation order only
PY
  done
  ;;
signal)
  # SIGTERM to one rank: every rank finishes its step, saves, and exits 0.
  run_ranks 2 "$work/s.log" --ckpt.path "$work/s" --optim.total_steps 100000 --logging.interval 1
  for _ in $(seq 200); do grep -q "step 3/" "$work/s.log.0" && break; sleep 0.1; done
  kill -TERM "${pids[1]}"
  wait_ranks || fail "a rank did not exit 0 after SIGTERM"
  grep -q "stopped by a signal after step .* (checkpoint saved)" "$work/s.log.0" || fail "no stop message"
  cat "$work/s/latest"
  [ -f "$work/s/$(cat "$work/s/latest")/meta.json" ] || fail "no checkpoint"
  ;;
kill_during_save)
  # Checkpoints every step of a model with a 32000-token vocabulary (a few hundred MB per save);
  # both ranks are killed with SIGKILL at some point during the run. Whatever the moment, the
  # newest complete checkpoint must load.
  run_ranks 2 "$work/k.log" --ckpt.path "$work/k" --ckpt.interval 1 --ckpt.keep 2 --model.vocab_size 32000 \
    --optim.total_steps 100000
  for _ in $(seq 300); do [ -f "$work/k/latest" ] && break; sleep 0.1; done
  sleep 1.3
  kill -9 "${pids[@]}"; wait_ranks
  ls -a "$work/k"
  run_ranks 2 "$work/r.log" --ckpt.path "$work/k" --ckpt.resume latest --model.vocab_size 32000 \
    --optim.total_steps 100000 --ckpt.interval 0
  for _ in $(seq 300); do grep -q "resumed from" "$work/r.log.0" && break; grep -q "error" "$work/r.log.0" && break; sleep 0.1; done
  kill -TERM "${pids[@]}"; wait_ranks
  grep "resumed from" "$work/r.log.0" || fail "could not resume after the kill"
  ;;
bad_checkpoint)
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --optim.total_steps 2
  wait_ranks || fail "run"
  ck="$work/a/step_00000002"
  before=$(cat "$ck"/* | sha256sum)
  # Another model shape.
  out=$("$train" "${common[@]}" --model.dim 128 --ckpt.resume "$ck" 2>&1); rc=$?
  echo "$out" | grep -q "checkpoint $ck: tok_embeddings.weight has shape \[1024,256\] there but \[1024,128\] in this model" \
    && [ $rc -ne 0 ] || fail "other model: $out"
  # Damaged: a truncated rank file, on a copy.
  cp -r "$ck" "$work/damaged"; truncate -s 1000 "$work/damaged/rank_00001.bin"
  out=$("$train" "${common[@]}" --ckpt.resume "$work/damaged" 2>&1); rc=$?
  echo "$out" | grep -q "rank_00001.bin has 1000 bytes, its index .* (truncated?)" && [ $rc -ne 0 ] || fail "damaged: $out"
  # Partial: no metadata (a save that never finished).
  cp -r "$ck" "$work/partial"; rm "$work/partial/meta.json"
  out=$("$train" "${common[@]}" --ckpt.resume "$work/partial" 2>&1); rc=$?
  echo "$out" | grep -q "not a complete checkpoint (no meta.json)" && [ $rc -ne 0 ] || fail "partial: $out"
  [ "$before" = "$(cat "$ck"/* | sha256sum)" ] || fail "the checkpoint changed"
  echo "other model, damaged and partial checkpoints refused; the checkpoint is untouched"
  ;;
hf_export)
  # A checkpoint saved on 2 ranks, exported; transformers' LlamaForCausalLM gives our logits.
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --optim.total_steps 3
  wait_ranks || fail "run"
  "$export_hf" "$work/a/step_00000003" "$work/hf" --check-logits || fail "export"
  "$python" "$(dirname "$0")/reference/hf_check.py" "$work/hf" 2>/dev/null || fail "logits differ"
  ;;
hf_roundtrip)
  # export -> import as a run's initial weights (2 ranks, one step at lr 0: the linear schedule's
  # multiplier is 0 at its last step) -> checkpoint -> export: the same bytes.
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --optim.total_steps 3
  wait_ranks || fail "run"
  "$export_hf" "$work/a/step_00000003" "$work/hf1" || fail "export 1"
  run_ranks 2 "$work/b.log" --ckpt.path "$work/b" --ckpt.init_from "$work/hf1" \
    --optim.sched_type linear --optim.warmup_steps 0 --optim.total_steps 1
  wait_ranks || fail "run from the exported model"
  grep -q "initial weights from" "$work/b.log.0" || fail "no import"
  "$export_hf" "$work/b/step_00000001" "$work/hf2" || fail "export 2"
  cmp "$work/hf1/model.safetensors" "$work/hf2/model.safetensors" || fail "safetensors differ"
  cmp "$work/hf1/config.json" "$work/hf2/config.json" || fail "config differs"
  echo "export -> import -> export: byte-identical ($(stat -c %s "$work/hf1/model.safetensors") bytes)"
  ;;
esac
echo PASS
