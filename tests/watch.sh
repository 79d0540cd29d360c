#!/usr/bin/env bash
# Watching runs, end to end with the real programs (tests/reference/watch_check.py reads back):
#   watch.sh CASE TRAIN_FSDP EXPORT_HF PYTHON   (run from anywhere; the corpus is data/python-docs)
# follower    a 20-step run with wandb = true and logging.tensorboard_dir (W&B offline): rank 0's
#             follower turns every record into TensorBoard events and a W&B run, read back with
#             tensorboard's event reader and wandb's own record reader, every scalar of every
#             step exact; the follower run again after the fact gives the same events.
# resumed     a run resumed from a checkpoint appends to its metrics: its follower reads past the
#             earlier run's final step to the new records, and continues the same W&B run.
# no_wandb    wandb = true where the follower's Python has no wandb: one warning, training goes on.
# plot        plot_runs.py draws two runs into one PNG.
# sample      sample.py generates from a checkpoint of the quick start and from its HF export with
#             the tokenizer the checkpoint kept: the same text both ways.
# shards      make_shards on a directory of parquet files and on a saved `datasets` dataset (the
#             same documents: the same shards), and train_fsdp on the parquet directory names the
#             make_shards command.
set -u
what=$1 train=$2 export_hf=$3 python=$4
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
data=$root/data/python-docs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
check() { "$python" "$root/tests/reference/watch_check.py" "$@" || fail "watch_check $*"; }
run=(--config "$root/configs/debug/quickstart.toml" --train.micro_bs 4 --optim.batch_size 4
     --data.seq_length 128 --optim.total_steps 20 --optim.warmup_steps 2 --data.eval_interval 10
     --optim.optim.ns_dtype float32 --runtime.num_threads 2
     --data.dataset_name_or_paths "$data/train" --data.val_dataset_name_or_paths "$data/val")

# The follower is detached: wait for its last line in the log beside the metrics.
wait_follower() {
  for _ in $(seq 240); do
    grep -q "follow_metrics: done" "$1/follower.log" 2>/dev/null && return 0
    sleep 0.5
  done
  cat "$1/follower.log" 2>/dev/null
  fail "the follower did not finish within 120 s"
}

case $what in
follower)
  out=$(WANDB_MODE=offline "$train" "${run[@]}" --wandb true --logging.tensorboard_dir "$work/tb" \
        --logging.metrics_file "$work/run/metrics.jsonl" --ckpt.path "" 2>&1) || fail "run: $out"
  echo "$out" | grep "metrics follower" || fail "no line about the follower"
  wait_follower "$work/run"
  cat "$work/run/follower.log"
  check tensorboard "$work/run/metrics.jsonl" "$work/tb"
  check wandb "$work/run/metrics.jsonl" "$work/run"
  "$python" "$root/scripts/watch/follow_metrics.py" "$work/run/metrics.jsonl" --tensorboard "$work/tb2" || fail "after the fact"
  check tensorboard "$work/run/metrics.jsonl" "$work/tb2"
  ;;
resumed)
  both=(--wandb true --logging.tensorboard_dir "$work/tb" --logging.metrics_file "$work/run/metrics.jsonl"
        --optim.total_steps 6 --data.eval_interval 3 --ckpt.path "$work/ckpt" --ckpt.interval 3 --ckpt.keep 0)
  WANDB_MODE=offline "$train" "${run[@]}" "${both[@]}" > "$work/first.log" 2>&1 || fail "first run: $(tail -3 "$work/first.log")"
  wait_follower "$work/run"
  grep -q "done, 6 records" "$work/run/follower.log" || fail "first follower: $(cat "$work/run/follower.log")"
  first_id=$(cat "$work/run/metrics.wandb_id")
  mv "$work/run/follower.log" "$work/first_follower.log"
  WANDB_MODE=offline "$train" "${run[@]}" "${both[@]}" --ckpt.resume "$work/ckpt/step_00000003" > "$work/second.log" 2>&1 \
    || fail "resumed run: $(tail -3 "$work/second.log")"
  wait_follower "$work/run"
  cat "$work/run/follower.log"
  # 6 records of the first run, then steps 4-6 again: 9, not a stop at the first run's step 6.
  grep -q "done, 9 records" "$work/run/follower.log" || fail "the resumed run's follower stopped early"
  [ "$(cat "$work/run/metrics.wandb_id")" = "$first_id" ] || fail "a new W&B run for the resumed training"
  grep -q "($first_id)" "$work/run/follower.log" || fail "the follower did not continue W&B run $first_id"
  ;;
no_wandb)
  # The same Python without its site-packages: no wandb there.
  printf '#!/bin/sh\nexec "%s" -S "$@"\n' "$python" > "$work/python-without-wandb"
  chmod +x "$work/python-without-wandb"
  out=$(ZB_PYTHON="$work/python-without-wandb" "$train" "${run[@]}" --optim.total_steps 4 --wandb true \
        --logging.metrics_file "$work/run/metrics.jsonl" --ckpt.path "" 2>&1) || fail "run: $out"
  echo "$out" | grep -q "done: 4 steps" || fail "training did not finish: $out"
  for _ in $(seq 60); do grep -q "wandb is not installed" "$work/run/follower.log" 2>/dev/null && break; sleep 0.5; done
  grep "warning: wandb is not installed" "$work/run/follower.log" || fail "no warning in the follower's log"
  echo "$out" | grep -q "warning: wandb is not installed" || fail "no warning on the trainer's stderr"
  ;;
plot)
  for lr in 0.02 0.01; do
    "$train" "${run[@]}" --optim.total_steps 6 --data.eval_interval 3 --wandb false --optim.optim.lr $lr \
      --logging.metrics_file "$work/lr$lr/metrics.jsonl" --ckpt.path "" > "$work/lr$lr.log" 2>&1 \
      || fail "run: $(tail -5 "$work/lr$lr.log")"
  done
  "$python" "$root/scripts/watch/plot_runs.py" "$work/lr0.02" "$work/lr0.01/metrics.jsonl" -o "$work/runs.png" --log-loss \
    || fail "plot_runs"
  check png "$work/runs.png"
  ;;
sample)
  "$train" "${run[@]}" --wandb false --ckpt.path "$work/ckpt" --logging.metrics_file "$work/run/metrics.jsonl" \
    > "$work/train.log" 2>&1 || fail "run: $(tail -5 "$work/train.log")"
  ckpt="$work/ckpt/$(cat "$work/ckpt/latest")"
  cmp "$ckpt/tokenizer.json" "$data/tokenizer.json" || fail "the checkpoint did not keep the data's tokenizer"
  "$export_hf" "$ckpt" "$work/hf" || fail "export_hf"
  sample=(--prompt "The " -n 2 --max-new-tokens 30 --seed 3)
  "$python" "$root/scripts/watch/sample.py" "$ckpt" "${sample[@]}" --export-hf "$export_hf" > "$work/from_ckpt.txt" \
    || fail "sample.py on the checkpoint"
  "$python" "$root/scripts/watch/sample.py" "$work/hf" "${sample[@]}" > "$work/from_hf.txt" || fail "sample.py on the export"
  cat "$work/from_ckpt.txt"
  cmp "$work/from_ckpt.txt" "$work/from_hf.txt" || fail "different samples from the checkpoint and its export"
  check sample "$work/from_ckpt.txt" "$work/hf"
  ;;
shards)
  check make_inputs "$data" "$work/in"   # parquet files and a saved dataset of the same documents
  for kind in parquet dataset; do
    "$python" "$root/scripts/data/make_shards.py" "$work/out-$kind" "$work/in/$kind" --tokenizer "$data/tokenizer.json" \
      --val-fraction 0.1 --shard-tokens 20000 > "$work/$kind.log" 2>&1 || fail "make_shards $kind: $(tail -3 "$work/$kind.log")"
    grep "tokens/s" "$work/$kind.log" | tail -1
  done
  check shards "$work/in" "$work/out-parquet" "$work/out-dataset" "$data/tokenizer.json"
  out=$("$train" "${run[@]}" --wandb false --data.dataset_name_or_paths "$work/in/parquet" --ckpt.path "" 2>&1) \
    && fail "trained on a parquet directory"
  echo "$out" | tail -4
  echo "$out" | grep -q "scripts/data/make_shards.py $work/in/parquet-shards $work/in/parquet --tokenizer" \
    || fail "no make_shards command in the error"
  ;;
*) fail "unknown case $what" ;;
esac
echo PASS
