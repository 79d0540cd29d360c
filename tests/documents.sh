#!/usr/bin/env bash
# Where documents come from, end to end on the embedded corpus (one process, 2 steps each):
#   documents.sh from_meta|no_delimiter  TRAIN_FSDP CONFIG DATA_DIR (the corpus: train/, val/, meta.json)
set -u
what=$1 train=$2 config=$3 data=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
common=(--config "$config" --model.vocab_size 1024 --train.micro_bs 2 --data.eval_interval 0
        --data.val_dataset_name_or_paths "$data/val"
        --optim.batch_size 2 --optim.total_steps 2 --optim.warmup_steps 1 --data.seq_length 128
        --optim.optim.ns_dtype float32 --ckpt.path "")

case $what in
from_meta)
  # make_shards' meta.json next to the shards says which token ends a document.
  out=$("$train" "${common[@]}" --data.dataset_name_or_paths "$data/train" 2>&1) || fail "run: $out"
  echo "$out" | grep -q "attention: within documents, split after token $(python3 -c "import json; print(json.load(open('$data/meta.json'))['eos'])")" \
    || fail "no line naming the document token: $out"
  ;;
no_delimiter)
  # Shards without meta.json: document attention refuses to start (exit 2, both ways out named);
  # with data.document_token, or with causal attention, the same shards train.
  cp "$data"/val/*.bin "$work/"
  out=$("$train" "${common[@]}" --data.dataset_name_or_paths "$work" 2>&1); rc=$?
  echo "$out" | tail -2
  [ $rc -eq 2 ] || fail "exit code $rc, expected 2"
  echo "$out" | grep -q "model.attention = \"document\" needs the token that marks documents.*set data.document_token" \
    || fail "message"
  out=$("$train" "${common[@]}" --data.dataset_name_or_paths "$work" --data.document_token 0 2>&1) || fail "with the token: $out"
  echo "$out" | grep -q "split after token 0" || fail "token not used: $out"
  out=$("$train" "${common[@]}" --data.dataset_name_or_paths "$work" --data.document_token 0 \
        --data.document_token_position opens 2>&1) || fail "opening token: $out"
  echo "$out" | grep -q "split before token 0" || fail "position not used: $out"
  "$train" "${common[@]}" --data.dataset_name_or_paths "$work" --model.attention causal >/dev/null 2>&1 || fail "causal"
  ;;
*) fail "unknown case $what" ;;
esac
echo PASS
