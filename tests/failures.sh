#!/usr/bin/env bash
# Runs that go wrong, with real processes (2 Gloo ranks): they stop cleanly, every rank with a
# non-zero exit code, and no good checkpoint is lost.
#   failures.sh nonfinite_stop|nonfinite_skip|unwritable_ckpt|short_write|publish_fails  TRAIN_FSDP CONFIG
set -u
what=$1 train=$2 config=$3 faulty=${4:-}  # faulty: tests/nonfinite_train.cpp's program
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/ranks.sh"

# all_finite DIR: every value of a checkpoint's rank files is finite.
all_finite() {
  python3 - "$1" <<'PY'
import array, glob, math, sys
for path in sorted(glob.glob(sys.argv[1] + "/rank_*.bin")):
    values = array.array("f", open(path, "rb").read())
    bad = sum(1 for v in values if not math.isfinite(v))
    if bad:
        sys.exit(f"{path}: {bad} non-finite values")
print(f"{sys.argv[1]}: all values finite")
PY
}
# expect_codes "CODES" LABEL: the exit codes of the ranks just waited for.
expect_codes() { [ "$codes" = "$1" ] || fail "$2: exit codes '$codes', expected '$1'"; }

case $what in
nonfinite_stop)
  # A learning rate that blows up: a run saves step 4, and its resume at AdamW lr 1e6 everywhere
  # (checkpoints every 4 steps) diverges. The first step with a non-finite loss or gradient norm
  # stops both ranks (exit 1) with one line naming the step and the last good checkpoint, step 4;
  # nothing of the diverged state is saved; step 4 is untouched and resumes at a sane rate.
  adamw=(--optim.optim.type adamw --ckpt.path "$work/ck" --ckpt.interval 4 --ckpt.keep 0)
  run_ranks 2 "$work/a.log" "${adamw[@]}" --optim.total_steps 4
  wait_ranks || fail "first run"
  before=$(cat "$work/ck/step_00000004"/* | sha256sum)
  lr=1e6
  run_ranks 2 "$work/d.log" "${adamw[@]}" --ckpt.resume latest --optim.optim.lr $lr \
    --optim.adam.lr_embedding $lr --optim.adam.lr_head $lr --optim.adam.lr_norm $lr
  wait_codes; expect_codes "1 1 " "divergence"
  grep -h "error: step" "$work/d.log.0"
  for r in 0 1; do
    grep -Eq "error: step [5-8]: the (loss|gradient norm|loss and gradient norm) is not finite .* the step was not applied; stopping \(train.nonfinite = \"stop\"\); nothing saved; the last good checkpoint is $work/ck/step_00000004" \
      "$work/d.log.$r" || fail "rank $r: no stop line naming the step and step_00000004"
  done
  ls -a "$work/ck"
  [ "$(ls -A "$work/ck")" = "$(printf 'latest\nstep_00000004')" ] || fail "the checkpoint directory holds $(ls -A "$work/ck")"
  [ "$before" = "$(cat "$work/ck/step_00000004"/* | sha256sum)" ] || fail "step 4 changed"
  all_finite "$work/ck/step_00000004" || fail "non-finite values in step 4"
  run_ranks 2 "$work/r.log" "${adamw[@]}" --ckpt.resume latest
  wait_ranks || fail "resuming from the last good checkpoint"
  grep "resumed from $work/ck/step_00000004" "$work/r.log.0" || fail "no resume"
  ;;
nonfinite_skip)
  # A NaN put into rank 1's reduced gradients at step 3 (the faulty test program): under "skip" both
  # ranks skip the step (the gradient norm is all-reduced), and the state saved after step 3 is
  # bit for bit the state after step 2 on every rank: parameters, momentum and Adam moments. The
  # schedule does not advance over the skipped step, and a resume from a later checkpoint
  # continues it exactly.
  train=$faulty ZB_TEST_NONFINITE_GRAD_STEPS=3 run_ranks 2 "$work/s.log" --train.nonfinite skip --ckpt.path "$work/s" \
    --ckpt.interval 1 --ckpt.keep 0 --logging.metrics_file "$work/s.jsonl"
  wait_ranks || fail "a run with a skipped step"
  for r in 0 1; do
    grep -q "step 3: the gradient norm is not finite (loss [0-9.]*, gradient norm nan), the step was not applied: skipped (1 in a row, 1 in all" \
      "$work/s.log.$r" || fail "rank $r did not log the skip"
    cmp "$work/s/step_00000002/rank_0000$r.bin" "$work/s/step_00000003/rank_0000$r.bin" || fail "rank $r: step 3 changed the state"
  done
  python3 - "$work/s.jsonl" <<'PY' || fail "metrics"
import json, sys
r = {x["step"]: x for x in map(json.loads, open(sys.argv[1]))}
assert r[3]["nonfinite"] == "gradient norm" and r[3]["grad_norm"] is None, r[3]
assert [r[s]["skipped_steps"] for s in range(1, 9)] == [0, 0, 1, 1, 1, 1, 1, 1]
assert r[4]["lr"] == r[3]["lr"] != r[2]["lr"], "the schedule advanced over the skipped step"
print("step 3 skipped on both ranks; the state after it is the state after step 2; lr at 4 =", r[4]["lr"])
PY
  run_ranks 2 "$work/r.log" --train.nonfinite skip --ckpt.path "$work/r" --ckpt.resume "$work/s/step_00000004" \
    --logging.metrics_file "$work/r.jsonl"
  wait_ranks || fail "resume"
  compare_losses "$work/s.jsonl" "$work/r.jsonl" 0 "resumed after a skipped step" || fail "resume after a skip"
  # train_ddp too: there each rank computes the norm from its own replica, and the step's
  # all-reduce carries whether any rank found it non-finite.
  train=$faulty ZB_TEST_PARALLELISM=ddp ZB_TEST_NONFINITE_GRAD_STEPS=3 run_ranks 2 "$work/ddp.log" \
    --train.nonfinite skip --ckpt.path "$work/ddp" --ckpt.interval 1 --optim.total_steps 3
  wait_ranks || fail "train_ddp with a skipped step"
  for r in 0 1; do
    cmp "$work/ddp/step_00000002/rank_0000$r.bin" "$work/ddp/step_00000003/rank_0000$r.bin" || fail "train_ddp: step 3 changed rank $r's rows"
  done
  # Too many in a row: train.max_skipped_steps = 2, non-finite at steps 3 and 4.
  train=$faulty ZB_TEST_NONFINITE_GRAD_STEPS=3,4 run_ranks 2 "$work/m.log" --train.nonfinite skip --train.max_skipped_steps 2 \
    --ckpt.path "$work/m" --ckpt.interval 1
  wait_codes; expect_codes "1 1 " "two non-finite steps in a row"
  for r in 0 1; do
    grep -q "error: step 4: the gradient norm is not finite .*; 2 such steps in a row (train.max_skipped_steps); nothing saved; the last good checkpoint is $work/m/step_00000003" \
      "$work/m.log.$r" || fail "rank $r: no stop after two skipped steps"
  done
  ;;
unwritable_ckpt)
  # Found before step 1: a ckpt.path that cannot be created, and one rank that cannot write a
  # file of 4 KiB (ulimit -f 1: its log still fits). Every rank exits 1 naming the problem.
  touch "$work/a-file"
  run_ranks 2 "$work/p.log" --ckpt.path "$work/a-file/ckpt"
  wait_codes; expect_codes "1 1 " "ckpt.path under a file"
  grep -q "checkpoint directory (ckpt.path) is not writable: cannot create directory $work/a-file/ckpt: Not a directory" \
    "$work/p.log.0" || fail "no message naming the directory"
  limit_rank=1 limit_kb=1 run_ranks 2 "$work/q.log" --ckpt.path "$work/q"
  wait_codes; expect_codes "1 1 " "a rank that cannot write"
  grep -q "not writable: writing [0-9]* bytes at offset [0-9]* of $work/q/.write-test-rank_00001.tmp failed: File too large" \
    "$work/q.log.1" || fail "rank 1: no message naming the file and the error"
  grep -q "checkpoint directory (ckpt.path) $work/q is not writable from 1 rank(s)" "$work/q.log.0" || fail "rank 0"
  ! grep -q "step 1/" "$work/p.log.0" "$work/q.log.0" || fail "trained before failing"
  ;;
short_write)
  # A save that fails midway on one rank (its file limited to 1 MiB, a rank's share is ~10 MiB):
  # both ranks stop with exit 1, the message names the file and the OS error, the temporary
  # directory is gone, and the previous checkpoint and `latest` are untouched.
  run_ranks 2 "$work/a.log" --ckpt.path "$work/ck" --optim.total_steps 4
  wait_ranks || fail "first run"
  before=$(cat "$work/ck/step_00000004"/* | sha256sum)
  limit_rank=1 limit_kb=1024 run_ranks 2 "$work/b.log" --ckpt.path "$work/ck" --ckpt.resume latest --ckpt.interval 2
  wait_codes; expect_codes "1 1 " "a short write"
  for r in 0 1; do
    grep -q "saving the checkpoint failed: rank 1: writing [0-9]* bytes at offset [0-9]* of $work/ck/.tmp-step_00000006/rank_00001.bin failed: File too large" \
      "$work/b.log.$r" || fail "rank $r: no message naming the file and the error"
  done
  ls -a "$work/ck"
  [ "$(ls -A "$work/ck")" = "$(printf 'latest\nstep_00000004')" ] || fail "the checkpoint directory holds $(ls -A "$work/ck")"
  [ "$(cat "$work/ck/latest")" = step_00000004 ] || fail "latest changed"
  [ "$before" = "$(cat "$work/ck/step_00000004"/* | sha256sum)" ] || fail "the previous checkpoint changed"
  ;;
publish_fails)
  # Every rank writes its files, then rank 0 fails to put the checkpoint into place (`latest.tmp`
  # is a directory here): a failure only rank 0 sees. It is the run's last save, after which no
  # step's flags would carry it: every rank must still exit 1 naming it, and `latest` stays absent.
  mkdir -p "$work/ck/latest.tmp/in-the-way"
  run_ranks 2 "$work/p.log" --ckpt.path "$work/ck" --optim.total_steps 2
  wait_codes; expect_codes "1 1 " "a checkpoint rank 0 cannot publish"
  for r in 0 1; do
    grep -q "saving the checkpoint failed: rank 0: .*latest.tmp" "$work/p.log.$r" || fail "rank $r: no message naming the failure"
  done
  [ ! -e "$work/ck/latest" ] || fail "latest was written"
  ;;
esac
echo PASS
