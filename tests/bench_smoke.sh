#!/usr/bin/env bash
# scripts/perf/bench.sh end to end on a tiny run: train_fsdp and the PyTorch FSDP2 peers (ZeroBand's
# muon-fsdp2 and torch.optim.Muon) on 2 Gloo ranks, 4 steps each. Checks the report has every
# row with real numbers, that all sides moved the same number of bytes in their gradient
# reduce-scatters (the same parameters sharded by rows in fp32): an independent check of our
# communication accounting against PyTorch's collectives; and that ZeroBand's Muon gathered and
# scattered each matrix once (its bytes per step from the matrices' sizes). Then a peer that
# cannot run (muon-fsdp2 with 3 ranks: 256 rows do not split evenly) gives its reason in the
# report in place of numbers. Every side's last step is profiled: operators dispatched per step.
# (TORCH_COMPILE_DISABLE: muon-fsdp2's Newton-Schulz eagerly; compiling it takes a minute here.)
#   bench_smoke.sh TRAIN_FSDP PYTHON
set -u
train=$1 python=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# On CPU wherever it runs (two ranks would not find two GPUs on a one-GPU machine).
OUT=$out WARMUP=1 ZB_SKIP_BUILD=1 PEER_COMPILE=0 TRAIN_FSDP=$train PYTHON=$python TORCH_COMPILE_DISABLE=1 \
  "$root/scripts/perf/bench.sh" "$root/configs/bench/cpu.toml" 2 4 --runtime.device cpu \
  --data.seq_length 128 --train.micro_bs 2 --optim.batch_size 4 || { echo "FAIL: bench.sh exited $?"; exit 1; }
"$python" - "$out/bench.json" "$out/run.json" <<'PY' || { echo "FAIL: report"; exit 1; }
import json, math, sys
b = json.load(open(sys.argv[1]))
ours, peer, torch_muon = (b["results"][k] for k in ("zeroband-cpp", "pytorch-zeroband-eager", "pytorch-torch-eager"))
for name, r in b["results"].items():
    print(name, {k: r[k] for k in ("tokens_per_second_per_rank", "step_seconds", "peak_memory_bytes", "comm_bytes_per_step")})
    assert r["tokens_per_second_per_rank"] > 0 and r["step_seconds"] > 0 and r["peak_memory_bytes"] > 0
    assert math.isfinite(r["final_loss"]) and r["forward_seconds"] > 0 and r["backward_seconds"] > 0
rs = [r["comm_bytes_per_step"]["reduce_scatter"] for r in (ours, peer, torch_muon)]
assert rs[0] == rs[1] == rs[2] > 0, f"reduce-scatter bytes differ: ours {rs[0]}, PyTorch {rs[1:]}"
# Rank 0 of 2 owns every other matrix (muon-fsdp2: matrix i on rank i % 2): for the ones it owns
# it receives the other half of the gradient and sends half of the result back; for the others it
# sends its half and receives its half. Either way each matrix moves half its fp32 size each way.
run = json.load(open(sys.argv[2]))
m = run["model"]
D, F, Q, K = m["dim"], m["ffn_hidden"], m["n_heads"] * m["head_dim"], m["n_kv_heads"] * m["head_dim"]
half = 4 * m["n_layers"] * (2 * Q * D + 2 * K * D + 3 * F * D) // 2
assert peer["comm_bytes_per_step"]["gather"] == half, (peer["comm_bytes_per_step"], half)
assert peer["comm_bytes_per_step"]["scatter"] == half, (peer["comm_bytes_per_step"], half)
assert "zeroband-cpp / pytorch-zeroband-eager" in b["ratios"] and "zeroband-cpp / pytorch-torch-eager" in b["ratios"]
# Every side's last step profiled: operators dispatched per step, and left out of the timings.
for name, r in b["results"].items():
    assert r["ops_dispatched_per_step"] > 100 and r["steps_measured"] == 1, (name, r)
assert all(q["ops_dispatched"] > 0 for q in b["ratios"].values()), b["ratios"]
PY
RANK=0 WORLD_SIZE=3 "$python" "$root/scripts/perf/bench_peer.py" --config-json "$out/run.json" --steps 2 \
  --metrics-file "$out/uneven.jsonl" > "$out/uneven.log" 2>&1 || { echo "FAIL: bench_peer exited $?"; cat "$out/uneven.log"; exit 1; }
"$python" "$root/scripts/perf/bench_report.py" --config-json "$out/run.json" --world-size 2 --warmup 1 \
  --out "$out/uneven.json" zeroband-cpp="$out/zeroband-cpp.jsonl" pytorch-zeroband-eager="$out/uneven.jsonl" \
  > "$out/uneven_report.txt" || { echo "FAIL: bench_report exited $?"; exit 1; }
grep -q "| pytorch-zeroband-eager | not run: muon-fsdp2 needs equal shards: wq (256 rows)" "$out/uneven_report.txt" \
  || { echo "FAIL: no reason in the report"; cat "$out/uneven_report.txt"; exit 1; }
echo PASS
