#!/usr/bin/env bash
# Checkpoints end to end with real processes:
#   checkpoints.sh exact_resume|other_world_size|signal|kill_during_save|bad_checkpoint|bad_import|hf_export|hf_roundtrip
#                  |ddp_exact_resume|ddp_to_fsdp|fsdp_to_ddp|hsdp_layouts  TRAIN_FSDP CONFIG PYTHON
set -u
what=$1 train=$2 config=$3 python=${4:-python3}
export_hf="$(dirname "$train")/export_hf"
train_fsdp=$train train_ddp="$(dirname "$train")/train_ddp"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/ranks.sh"

case $what in
exact_resume)
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --ckpt.interval 4 --ckpt.keep 0 --logging.metrics_file "$work/a.jsonl"
  wait_ranks || fail "straight run"
  run_ranks 2 "$work/b.log" --ckpt.path "$work/b" --ckpt.resume "$work/a/step_00000004" --logging.metrics_file "$work/b.jsonl"
  wait_ranks || fail "resumed run"
  compare_losses "$work/a.jsonl" "$work/b.jsonl" 0 "saved at step 4 on 2 ranks, resumed on 2" || fail "losses differ"
  ;;
other_world_size)
  run_ranks 4 "$work/a.log" --ckpt.path "$work/a" --ckpt.interval 4 --ckpt.keep 0 --logging.metrics_file "$work/a.jsonl"
  wait_ranks || fail "4-rank run"
  for w in 2 3; do
    run_ranks $w "$work/r$w.log" --ckpt.path "$work/r$w" --ckpt.resume "$work/a/step_00000004" \
      --logging.metrics_file "$work/r$w.jsonl"
    wait_ranks || fail "resume on $w ranks"
    # fp32, different summation order only.
    compare_losses "$work/a.jsonl" "$work/r$w.jsonl" 1e-4 "saved on 4 ranks, resumed on $w" || fail "losses on $w ranks"
  done
  ;;
signal)
  # SIGTERM to one rank: every rank finishes its step (or the next), saves, and exits 0.
  run_ranks 2 "$work/s.log" --ckpt.path "$work/s" --optim.total_steps 100000 --logging.interval 1
  for _ in $(seq 200); do grep -q "step 3/" "$work/s.log.0" && break; sleep 0.1; done
  kill -TERM "${pids[1]}"
  wait_ranks || fail "a rank did not exit 0 after SIGTERM"
  grep -q "stopped by a signal after step .* (checkpoint saved)" "$work/s.log.0" || fail "no stop message"
  cat "$work/s/latest"
  [ -f "$work/s/$(cat "$work/s/latest")/meta.json" ] || fail "no checkpoint"
  ;;
kill_during_save)
  # Saves every step, keeping one; the writers of step 5's save stop inside it on purpose (a
  # test-only hook, after each rank's data file, before its index and the commit) and both ranks
  # are killed with SIGKILL there. The newest complete checkpoint (step 4) must be there and load,
  # and the resumed run must end with exactly the losses of a run never interrupted. Rotation
  # deletes only checkpoints older than the one just saved: a newer one left by an earlier run
  # (step 99 here) stays, and `latest` always names a checkpoint that exists.
  run_ranks 2 "$work/straight.log" --logging.metrics_file "$work/straight.jsonl"
  wait_ranks || fail "straight run"
  export ZB_TEST_PAUSE_SAVE_AT_STEP=5
  run_ranks 2 "$work/k.log" --ckpt.path "$work/k" --ckpt.interval 1 --ckpt.keep 1 \
    --logging.metrics_file "$work/k.jsonl"
  unset ZB_TEST_PAUSE_SAVE_AT_STEP
  for _ in $(seq 600); do
    grep -q "writer paused inside the save of step 5" "$work/k.log.0" &&
      grep -q "writer paused inside the save of step 5" "$work/k.log.1" && break
    sleep 0.1
  done
  grep -q "writer paused" "$work/k.log.1" || fail "the save of step 5 never paused"
  kill -9 "${pids[@]}"; wait_ranks
  ls -a "$work/k"
  [ -d "$work/k/.tmp-step_00000005" ] || fail "the kill did not land inside the save of step 5"
  [ "$(cat "$work/k/latest")" = step_00000004 ] || fail "latest is $(cat "$work/k/latest"), not step_00000004"
  [ "$(cd "$work/k" && echo step_*)" = step_00000004 ] || fail "keep = 1 left $(cd "$work/k" && echo step_*)"
  cp -r "$work/k/step_00000004" "$work/k/step_00000099"
  run_ranks 2 "$work/r.log" --ckpt.path "$work/k" --ckpt.interval 1 --ckpt.keep 1 --ckpt.resume latest \
    --logging.metrics_file "$work/r.jsonl"
  wait_ranks || fail "could not resume after the kill"
  grep "resumed from" "$work/r.log.0" || fail "no resume"
  compare_losses "$work/straight.jsonl" "$work/r.jsonl" 0 "killed inside the save of step 5, resumed from step 4" \
    || fail "losses differ from the uninterrupted run"
  ls -a "$work/k"
  [ "$(cat "$work/k/latest")" = step_00000008 ] && [ -f "$work/k/step_00000008/meta.json" ] || fail "latest after the resumed run"
  [ "$(cd "$work/k" && echo step_*)" = "step_00000008 step_00000099" ] || fail "rotation kept $(cd "$work/k" && echo step_*)"
  ;;
ddp_exact_resume)
  # train_ddp saves and resumes, bit-exact on the same world size.
  train=$train_ddp
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --ckpt.interval 4 --ckpt.keep 0 --logging.metrics_file "$work/a.jsonl"
  wait_ranks || fail "straight DDP run"
  run_ranks 2 "$work/b.log" --ckpt.path "$work/b" --ckpt.resume "$work/a/step_00000004" --logging.metrics_file "$work/b.jsonl"
  wait_ranks || fail "resumed DDP run"
  compare_losses "$work/a.jsonl" "$work/b.jsonl" 0 "train_ddp saved at step 4 on 2 ranks, resumed on 2" || fail "losses differ"
  ;;
ddp_to_fsdp|fsdp_to_ddp)
  # One format for both engines: saved by one on 2 ranks, resumed by the other on 3; the
  # losses follow the saving run's within fp32 summation-order noise.
  if [ "$what" = ddp_to_fsdp ]; then first=$train_ddp second=$train_fsdp; else first=$train_fsdp second=$train_ddp; fi
  train=$first
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --ckpt.interval 4 --ckpt.keep 0 --logging.metrics_file "$work/a.jsonl"
  wait_ranks || fail "$(basename "$first") on 2 ranks"
  train=$second
  run_ranks 3 "$work/b.log" --ckpt.path "$work/b" --ckpt.resume "$work/a/step_00000004" --logging.metrics_file "$work/b.jsonl"
  wait_ranks || fail "$(basename "$second") resuming on 3 ranks"
  grep "resumed from" "$work/b.log.0" || fail "no resume"
  compare_losses "$work/a.jsonl" "$work/b.jsonl" 1e-4 \
    "saved by $(basename "$first") on 2 ranks, resumed by $(basename "$second") on 3" || fail "losses differ"
  ;;
hsdp_layouts)
  # Hybrid sharding's checkpoints are the same format: HSDP 2x2 -> FSDP on 4 -> FSDP on 3 ->
  # HSDP 2x2, each resuming the one before two steps on, and HSDP -> train_ddp -> HSDP 1x4; the
  # losses follow the straight run.
  hsdp=(--parallel.dp_shard 2 --parallel.dp_replicate 2)
  run_ranks 4 "$work/a.log" "${hsdp[@]}" --ckpt.path "$work/a" --ckpt.interval 2 --ckpt.keep 0 \
    --logging.metrics_file "$work/a.jsonl"
  wait_ranks || fail "HSDP 2x2"
  grep -q "hybrid sharding: parameters sharded over groups of 2" "$work/a.log.0" || fail "not hybrid"
  # The second replica (ranks 2 and 3) saves no rows: each shard is written once.
  "$python" - "$work/a/step_00000002" <<'PY' || fail "replicas wrote rows twice"
import json, sys
for r in range(4):
    index = json.load(open(f"{sys.argv[1]}/rank_{r:05d}.json"))
    rows = sum(1 for e in index if e["global_shape"])
    print(f"rank {r}: {rows} row entries, {len(index) - rows} scalars")
    assert (rows > 0) == (r < 2), f"rank {r} saved {rows} row entries"
PY
  run_ranks 4 "$work/b.log" --ckpt.path "$work/b" --ckpt.interval 2 --ckpt.keep 0 \
    --ckpt.resume "$work/a/step_00000002" --logging.metrics_file "$work/b.jsonl"
  wait_ranks || fail "FSDP on 4 from HSDP"
  run_ranks 3 "$work/c.log" --ckpt.path "$work/c" --ckpt.interval 2 --ckpt.keep 0 \
    --ckpt.resume "$work/b/step_00000004" --logging.metrics_file "$work/c.jsonl"
  wait_ranks || fail "FSDP on 3"
  run_ranks 4 "$work/d.log" "${hsdp[@]}" --ckpt.path "$work/d" --ckpt.resume "$work/c/step_00000006" \
    --logging.metrics_file "$work/d.jsonl"
  wait_ranks || fail "HSDP 2x2 from FSDP on 3"
  compare_losses "$work/a.jsonl" "$work/b.jsonl" 1e-4 "HSDP 2x2 -> FSDP 4" 3 8 || fail "FSDP 4"
  compare_losses "$work/a.jsonl" "$work/c.jsonl" 1e-4 "-> FSDP 3" 5 8 || fail "FSDP 3"
  compare_losses "$work/a.jsonl" "$work/d.jsonl" 1e-4 "-> HSDP 2x2" 7 8 || fail "HSDP again"
  # And train_ddp: on 2 ranks from HSDP's step 4, then HSDP 1x4 from DDP's step 6.
  train=$train_ddp
  run_ranks 2 "$work/e.log" --ckpt.path "$work/e" --ckpt.interval 2 --ckpt.keep 0 \
    --ckpt.resume "$work/a/step_00000004" --logging.metrics_file "$work/e.jsonl"
  wait_ranks || fail "DDP from HSDP"
  train=$train_fsdp
  run_ranks 4 "$work/f.log" --parallel.dp_shard 1 --parallel.dp_replicate 4 --ckpt.path "$work/f" \
    --ckpt.resume "$work/e/step_00000006" --logging.metrics_file "$work/f.jsonl"
  wait_ranks || fail "HSDP 1x4 from DDP"
  compare_losses "$work/a.jsonl" "$work/e.jsonl" 1e-4 "HSDP 2x2 -> DDP 2" 5 8 || fail "DDP"
  compare_losses "$work/a.jsonl" "$work/f.jsonl" 1e-4 "-> HSDP 1x4" 7 8 || fail "HSDP 1x4"
  ;;
bad_checkpoint)
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --optim.total_steps 2
  wait_ranks || fail "run"
  ck="$work/a/step_00000002"
  before=$(cat "$ck"/* | sha256sum)
  # Another model shape.
  out=$("$train" "${common[@]}" --model.dim 64 --ckpt.resume "$ck" 2>&1); rc=$?
  echo "$out" | grep -q "checkpoint $ck: tok_embeddings.weight has shape \[1024,128\] there but \[1024,64\] in this model" \
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
bad_import)
  # Damaged Hugging Face directories and checkpoints: one line naming the file and the problem,
  # exit 1, before any training (each check below takes well under a second).
  run_ranks 2 "$work/a.log" --ckpt.path "$work/a" --optim.total_steps 1
  wait_ranks || fail "run"
  ck="$work/a/step_00000001"
  "$export_hf" "$ck" "$work/hf" >/dev/null || fail "export"
  # damaged NAME PYTHON: a copy of the export, changed by the Python snippet (in the copy's folder).
  damaged() {
    rm -rf "$work/$1"; cp -r "$work/hf" "$work/$1"
    (cd "$work/$1" && python3 -c "$2") || fail "damaging $1"
  }
  # refused DIR PATTERN [ARGS...]: init_from DIR fails with exit 1 and PATTERN (grep -E), untrained.
  refused() {
    local dir=$1 pattern=$2; shift 2
    out=$("$train" "${common[@]}" --ckpt.init_from "$dir" "$@" 2>&1); rc=$?
    echo "$out" | grep -E "error: " | head -1
    [ $rc -eq 1 ] && echo "$out" | grep -Eq -- "$pattern" && ! echo "$out" | grep -q "step 1/" \
      || fail "init_from $dir (exit $rc): $out"
  }
  # The safetensors header as (length, JSON, data); rewrite() writes a changed header back.
  st='import json, struct
b = open("model.safetensors", "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); d = b[8 + n:]
def rewrite(h):
    t = json.dumps(h).encode(); t += b" " * (-len(t) % 8)
    open("model.safetensors", "wb").write(struct.pack("<Q", len(t)) + t + d)
'
  damaged nokey 'import json; c = json.load(open("config.json")); del c["hidden_size"]; json.dump(c, open("config.json", "w"))'
  refused "$work/nokey" "$work/nokey/config.json: missing key 'hidden_size'"
  damaged notjson 'open("config.json", "a").write("}")'
  refused "$work/notjson" "$work/notjson/config.json: not valid JSON"
  damaged truncated 'import os; os.truncate("model.safetensors", os.path.getsize("model.safetensors") - 1000)'
  refused "$work/truncated" "$work/truncated/model.safetensors: model\.[a-z_.0-9]+: data_offsets \[[0-9]+, [0-9]+\] outside the file's [0-9]+ data bytes \(truncated\?\)"
  damaged stub 'open("model.safetensors", "wb").write(b"\x10\x00")'
  refused "$work/stub" "$work/stub/model.safetensors: 2 bytes, shorter than the 8-byte header length"
  damaged dtype "$st"'
h["model.norm.weight"]["dtype"] = "F16"; rewrite(h)'
  refused "$work/dtype" "$work/dtype/model.safetensors: model.norm.weight has dtype F16, expected F32"
  damaged shape "$st"'
e = h["model.norm.weight"]; e["shape"] = [e["shape"][0] // 2, 2]; rewrite(h)'
  refused "$work/shape" "$work/shape/model.safetensors: model.norm.weight has shape \[64,2\], but config.json's model needs \[128\]"
  damaged missing "$st"'
del h["lm_head.weight"]; rewrite(h)'
  refused "$work/missing" "$work/missing/model.safetensors: no tensor lm_head.weight"
  refused "$work/hf" "model $work/hf: tok_embeddings.weight has shape \[1024,128\] there but \[1024,64\] in this run's model \(a model of another size\?\)" --model.dim 64
  # export_hf on damaged checkpoints.
  exported() {
    out=$("$export_hf" "$1" "$work/out" 2>&1); rc=$?
    echo "$out"
    [ $rc -eq 1 ] && echo "$out" | grep -Eq -- "$2" || fail "export_hf $1 (exit $rc): $out"
  }
  cp -r "$ck" "$work/c1"; truncate -s 1000 "$work/c1/rank_00001.bin"
  exported "$work/c1" "export_hf: $work/c1/rank_00001.bin has 1000 bytes, but model/[a-z_.0-9]+'s rows end at byte [0-9]+ \(truncated\?\)"
  cp -r "$ck" "$work/c2"; rm "$work/c2/meta.json"
  exported "$work/c2" "export_hf: checkpoint $work/c2: not a complete checkpoint \(no meta.json\)"
  cp -r "$ck" "$work/c3"; echo '[{"name": ' > "$work/c3/rank_00000.json"
  exported "$work/c3" "export_hf: $work/c3/rank_00000.json: not valid JSON"
  cp -r "$ck" "$work/c4"; rm "$work/c4/rank_00001.bin"
  exported "$work/c4" "export_hf: cannot read $work/c4/rank_00001.bin: No such file or directory"
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
