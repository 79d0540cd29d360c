#!/usr/bin/env bash
# Throughput, MFU and memory of train_fsdp side by side with PyTorch's own FSDP2 on the same model,
# batch, dtype, world size and optimizers (scripts/perf/bench_peer.py), on fake data. Prints a table
# and writes OUT/bench.json with both rows and the ratio ours / PyTorch.
#
#   scripts/perf/bench.sh [CONFIG] [NPROC] [STEPS] [extra train arguments...]
#   scripts/perf/bench.sh                                    # CPU: configs/bench/cpu.toml, 2 Gloo ranks, 25 steps
#   scripts/perf/bench.sh configs/1B/H100.toml 1 30 --train.micro_bs 8   # one GPU, bf16
#   scripts/perf/bench.sh configs/bench/cpu.toml 4 8 --parallel.tp 2 --optim.optim.type adamw
#                                 # TP 2 x FSDP 2: the peer is FSDP2 over a (dp_shard, tp) mesh's
#                                 # dp_shard dimension with DTensor TP over its tp dimension
#
# Environment: OUT (output folder), WARMUP (first steps left out, default 5), PEERS (the peers'
# Muon: "zeroband" = ZeroBand's muon-fsdp2, "torch" = torch.optim.Muon; default both),
# PEER_COMPILE (1: each peer also torch.compile'd; default 1 on GPU, 0 on CPU), PEER_MASK (the
# peers' document mask: auto, flex or sdpa; see bench_peer.py --mask-kernel), ZB_SKIP_BUILD=1
# (use the build as is), TRAIN_FSDP (the binary, default build/apps/train_fsdp), PYTHON (default
# .venv/bin/python), BENCH_COMMIT (the commit to report, where git's HEAD is not the tree's:
# the device tool's copies). Rows: zeroband-cpp, then pytorch-MUON-eager / pytorch-MUON-compile; with
# --optim.optim.type adamw one peer, pytorch-adamw-eager / -compile (no Muon to choose).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
gpu=0
nvidia-smi -L >/dev/null 2>&1 && gpu=1
config=${1:-$ROOT/configs/bench/cpu.toml}
nproc=${2:-$([ $gpu = 1 ] && echo 1 || echo 2)}
steps=${3:-25}
shift $(( $# > 3 ? 3 : $# ))
warmup=${WARMUP:-5}
compile=${PEER_COMPILE:-$gpu}
[ "${ZB_SKIP_BUILD:-0}" = 1 ] || "$ROOT/scripts/build.sh" >/dev/null
cd "$ROOT"
train=${TRAIN_FSDP:-build/apps/train_fsdp}
python=${PYTHON:-.venv/bin/python}
out=${OUT:-outputs/bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"

# The same overrides for both sides: fake data, a fixed number of steps, no checkpoints,
# validation or metrics follower; on CPU the ranks share the cores. The peers mask documents as ZeroBand does (flex
# attention on CUDA, SDPA with a dense mask on CPU, where flex cannot train); `--model.attention
# causal` runs every side across whole rows.
# Newton-Schulz in bf16 on every side, the CPU included: both peers' Muon knows no other precision
# (train_fsdp alone would choose fp32 on a CPU, optim.optim.ns_dtype = auto).
args=(--config "$config" --data.fake --optim.total_steps "$steps" --ckpt.path "" --data.eval_interval 0
      --wandb false --optim.optim.ns_dtype bfloat16 "$@")
threads=0
if [ $gpu = 0 ]; then
  threads=$(( $(nproc) / nproc > 0 ? $(nproc) / nproc : 1 ))
  args+=(--runtime.num_threads "$threads")
fi
# The same allocator settings for both sides (train_fsdp would choose these itself; see
# configure_allocator in src/util/device.cpp), so the comparison is of the trainers alone.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-33554432}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-1073741824}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# The resolved run for the peer, checked for this world size first.
RANK=0 WORLD_SIZE=$nproc LOCAL_RANK=0 LOCAL_WORLD_SIZE=$nproc \
  "$train" "${args[@]}" --print-config > "$out/run.json" || { cat "$out/run.json"; exit 2; }

torchrun=("$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc")
# On failure, the log's first error lines (torchrun's own summary comes last and says little).
failed() { echo "FAILED: $1"; grep -v "^W[0-9]" "$1" | grep -i -m 20 -E "bench_peer:|error|terminate|exception|abort|assert"; exit 1; }
echo "== zeroband-cpp train_fsdp, $nproc rank(s): $config"
# Every side's last step is recorded by its profiler for the operators it dispatches (left out of
# the timings by bench_report.py). A relative traces folder goes beside the metrics file: into $out.
"${torchrun[@]}" --no-python "$train" "${args[@]}" --logging.metrics_file "$out/zeroband-cpp.jsonl" \
  --profiling.enable_profiling true --profiling.profile_freq "$steps" --profiling.profile_active 1 \
  --profiling.save_traces_folder zeroband-cpp-profile \
  > "$out/zeroband-cpp.log" 2>&1 || failed "$out/zeroband-cpp.log"
grep -E "step [0-9]+/[0-9]+ \|" "$out/zeroband-cpp.log" | tail -1 || true  # progress line, for the eye
runs=(zeroband-cpp="$out/zeroband-cpp.jsonl")
modes=(eager)
[ "$compile" = 1 ] && modes+=(compile)
# AdamW on the hidden matrices too leaves no Muon to choose: the peers would be the same run.
read -r hidden tp < <("$python" -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["hidden"]["type"], r["parallel"]["tp"])' "$out/run.json")
peers=${PEERS:-zeroband torch}
[ "$hidden" = adamw ] && peers=adamw
layout="FSDP2"
[ "$tp" -gt 1 ] && layout="FSDP2 x DTensor TP $tp"
for muon in $peers; do
  for mode in "${modes[@]}"; do
    name=pytorch-$muon-$mode
    if [ "$muon" = adamw ]; then
      echo "== PyTorch $layout with AdamW ($mode), $nproc rank(s)"
      extra=()
    else
      echo "== PyTorch $layout with $muon's Muon ($mode), $nproc rank(s)"
      extra=(--muon "$muon")
    fi
    [ "$mode" = compile ] && extra+=(--compile)
    "${torchrun[@]}" scripts/perf/bench_peer.py --mask-kernel "${PEER_MASK:-auto}" --config-json "$out/run.json" --steps "$steps" \
      --num-threads "$threads" --metrics-file "$out/$name.jsonl" --profile-step "$steps" "${extra[@]}" \
      > "$out/$name.log" 2>&1 || failed "$out/$name.log"
    grep -E "peer step|not run" "$out/$name.log" | tail -1 || true
    runs+=("$name=$out/$name.jsonl")
  done
done

if grep -q '"resolved_device": "cuda"' "$out/run.json"; then
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
else
  device="$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores"
fi
meta=$("$python" -c 'import json, sys; print(json.dumps({"date": sys.argv[1], "commit": sys.argv[2], "command": sys.argv[3]}))' \
  "$(date -u +%Y-%m-%dT%H:%MZ)" "${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
  "scripts/perf/bench.sh $config $nproc $steps $*")
echo
"$python" scripts/perf/bench_report.py --config-json "$out/run.json" --world-size "$nproc" \
  --warmup "$warmup" --device "$device" --meta "$meta" --out "$out/bench.json" \
  --profile-summary "$out/zeroband-cpp-profile/iteration_$steps/rank0_summary.json" "${runs[@]}"
echo
echo "results: $out/bench.json"
