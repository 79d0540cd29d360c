#!/usr/bin/env bash
# scripts/bench.sh end to end on a tiny run: train_fsdp and the PyTorch FSDP2 peer on 2 Gloo ranks,
# 4 steps each. Checks the report has both rows with real numbers, and that both sides moved the
# same number of bytes in their gradient reduce-scatters (the same parameters sharded by rows in
# fp32): an independent check of our communication accounting against PyTorch's collectives.
#   bench_smoke.sh TRAIN_FSDP PYTHON
set -u
train=$1 python=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# On CPU wherever it runs (two ranks would not find two GPUs on a one-GPU machine).
OUT=$out WARMUP=1 ZB_SKIP_BUILD=1 PEER_COMPILE=0 TRAIN_FSDP=$train PYTHON=$python \
  "$root/scripts/bench.sh" "$root/configs/bench/cpu.toml" 2 4 --runtime.device cpu \
  --data.seq_length 128 --train.micro_bs 2 --optim.batch_size 4 || { echo "FAIL: bench.sh exited $?"; exit 1; }
"$python" - "$out/bench.json" <<'PY' || { echo "FAIL: report"; exit 1; }
import json, math, sys
b = json.load(open(sys.argv[1]))
ours, peer = b["results"]["zeroband-cpp"], b["results"]["pytorch-eager"]
for name, r in b["results"].items():
    print(name, {k: r[k] for k in ("tokens_per_second_per_rank", "step_seconds", "peak_memory_bytes", "comm_bytes_per_step")})
    assert r["tokens_per_second_per_rank"] > 0 and r["step_seconds"] > 0 and r["peak_memory_bytes"] > 0
    assert math.isfinite(r["final_loss"]) and r["forward_seconds"] > 0 and r["backward_seconds"] > 0
rs = ours["comm_bytes_per_step"]["reduce_scatter"], peer["comm_bytes_per_step"]["reduce_scatter"]
assert rs[0] == rs[1] > 0, f"reduce-scatter bytes differ: ours {rs[0]}, PyTorch {rs[1]}"
ratio = b["ratios"]["zeroband-cpp / pytorch-eager"]["tokens_per_second"]
assert ratio == ours["tokens_per_second_per_rank"] / peer["tokens_per_second_per_rank"]
PY
echo PASS
