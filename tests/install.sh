#!/usr/bin/env bash
# `cmake --install` gives a tree that can be moved: installed into one prefix and moved to another,
# train_fsdp trains from the installed presets and starts the installed metrics follower (found
# beside the program, not in the source tree), which turns the run's records into TensorBoard
# events. Prints PASS last.
#   install.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

cmake --install "$build" --prefix "$work/first" >/dev/null
mv "$work/first" "$work/moved"
prefix=$work/moved
for f in bin/train_fsdp bin/train_ddp bin/train_hsdp bin/export_hf share/zeroband-cpp/scripts/watch/follow_metrics.py \
         share/zeroband-cpp/scripts/data/make_shards.py share/zeroband-cpp/configs/debug/normal.toml; do
  [ -e "$prefix/$f" ] || fail "the install has no $f"
done

cd "$work"  # nowhere near the source tree
out=$("$prefix/bin/train_fsdp" --config "$prefix/share/zeroband-cpp/configs/debug/normal.toml" --data.fake \
      --optim.total_steps 2 --ckpt.path "" --runtime.num_threads 2 \
      --logging.metrics_file "$work/run/metrics.jsonl" --logging.tensorboard_dir "$work/run/tb" 2>&1) \
  || { echo "$out"; fail "the installed train_fsdp failed"; }
echo "$out"
echo "$out" | grep -q "metrics follower: .* $prefix/share/zeroband-cpp/scripts/watch/follow_metrics.py" \
  || fail "the follower did not come from the installed tree"
for _ in $(seq 120); do
  grep -q "follow_metrics: done, 2 records" "$work/run/follower.log" 2>/dev/null && break
  sleep 0.5
done
cat "$work/run/follower.log"
grep -q "follow_metrics: done, 2 records" "$work/run/follower.log" || fail "the follower did not finish"
ls "$work/run/tb"/events.* >/dev/null 2>&1 || fail "no TensorBoard events"
echo PASS
