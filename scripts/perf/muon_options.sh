#!/usr/bin/env bash
# What Muon at scale's options cost a step: a preset trained STEPS steps as it is (Jordan's
# Newton-Schulz coefficients), with Polar Express's, with Gram Newton-Schulz, with the attention
# logits' watch, and with QK-clip (Polar Express's coefficients, a threshold that clips some heads
# every step), ROUNDS
# times each in turn (the machine's noise shows as the spread), and a table of seconds per step
# (the best and the worst round) and each option's best over the plain run's best.
#
#   scripts/perf/muon_options.sh CONFIG [STEPS] [-- extra train_fsdp arguments]   # STEPS default 12
#   scripts/perf/muon_options.sh configs/debug/normal.toml 12 -- --runtime.device cpu
#
# Environment: OUT (default outputs/muon-options-TIME), ROUNDS (default 2), OPTIONS (which of
# "jordan polar_express gram watch qk_clip", the default, to run; jordan always), QK_CLIP_THRESHOLD
# (default 0.5: below the debug and 150M presets' logits on fake data at the start, so that the
# clip works). Steps before the 4th are left out of the time.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
config=${1:?usage: muon_options.sh CONFIG [STEPS] [-- train_fsdp arguments]}
shift
steps=${1:-12}
shift $(($# > 0 ? 1 : 0))
[ "${1:-}" = "--" ] && shift
cd "$ROOT"
out=${OUT:-outputs/muon-options-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
base=(--config "$config" --optim.total_steps "$steps" --ckpt.path "" --data.eval_interval 0 --wandb false
      --logging.interval 1000 "$@")
declare -A variant=(
  [jordan]=""
  [polar_express]="--optim.optim.ns_coefficients polar_express"
  [gram]="--optim.optim.ns_algorithm gram"
  [watch]="--logging.max_attention_logit true"
  [qk_clip]="--optim.optim.ns_coefficients polar_express --optim.optim.qk_clip_threshold ${QK_CLIP_THRESHOLD:-0.5}"
)
read -r -a order <<<"${OPTIONS:-jordan polar_express gram watch qk_clip}"
[[ " ${order[*]} " == *" jordan "* ]] || order=(jordan "${order[@]}")
rounds=${ROUNDS:-2}
for round in $(seq "$rounds"); do
  for name in "${order[@]}"; do
    read -r -a extra <<<"${variant[$name]}"
    echo "== $name ($round): train_fsdp ${base[*]} ${extra[*]}"
    build/apps/train_fsdp "${base[@]}" "${extra[@]}" --logging.metrics_file "$out/$name.$round.jsonl" \
      >"$out/$name.$round.log" 2>&1 || { tail -20 "$out/$name.$round.log"; echo "muon_options: $name failed" >&2; exit 1; }
  done
done

.venv/bin/python - "$out" "$steps" "$config" "$rounds" "${order[@]}" <<'PY'
import json, os, sys
out, steps, config, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:]
warmup = min(3, steps - 2)
rows = {}
for name in names:
    times, last = [], None
    for round in range(1, rounds + 1):
        records = [json.loads(l) for l in open(os.path.join(out, f"{name}.{round}.jsonl"))]
        kept = records[warmup:]
        times.append((kept[-1]["time"] - kept[0]["time"]) / (len(kept) - 1))
        last = records[-1]
    rows[name] = (min(times), max(times), last["loss"], sum(r.get("qk_clipped_heads", 0) for r in records))
plain = rows["jordan"][0]
print(f"\n{config}, steps {warmup + 1}..{steps} timed, {rounds} runs each ({out}):")
print("| option | s/step (best, worst) | x jordan (best) | loss at step %d | heads clipped |" % steps)
print("|---|---|---|---|---|")
for name, (best, worst, loss, clipped) in rows.items():
    print(f"| {name} | {best:.3f}, {worst:.3f} | {best / plain:.3f} | {loss:.4f} | {clipped} |")
json.dump({n: {"seconds_per_step": [b, w], "over_jordan": b / plain, "final_loss": l, "heads_clipped": c}
           for n, (b, w, l, c) in rows.items()}, open(os.path.join(out, "muon_options.json"), "w"), indent=2)
PY
