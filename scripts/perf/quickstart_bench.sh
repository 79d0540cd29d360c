#!/usr/bin/env bash
# Are the quick start's defaults the fast ones on this machine? Trains the quick start's first
# STEPS steps (configs/debug/quickstart.toml, its real data; no checkpoint, validation or
# sample) as shipped and with each precision or kernel choice forced, one run after another, and
# prints a table of seconds per step, each variant's time over the shipped one's, and the final
# loss (the same data and seed every time).
#
#   scripts/perf/quickstart_bench.sh [STEPS] [-- extra train_fsdp arguments]   # STEPS default 20
#
# Environment: ZB_SKIP_BUILD=1 (use build/ as it is), OUT (default outputs/quickstart-bench-TIME),
# VARIANTS (names from the list below, default all). Steps before the 5th are left out of the
# time (start-up, allocator growth).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
steps=${1:-20}
shift $(($# > 0 ? 1 : 0))
[ "${1:-}" = "--" ] && shift
[ "${ZB_SKIP_BUILD:-0}" = 1 ] || "$ROOT/scripts/build.sh" >/dev/null
cd "$ROOT"
out=${OUT:-outputs/quickstart-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"

base=(--config configs/debug/quickstart.toml --optim.total_steps "$steps" --ckpt.path "" --data.eval_interval 0
      --wandb false --logging.interval 1000 "$@")
# name | what it forces
declare -A variant=(
  [shipped]=""
  [ns_bfloat16]="--optim.optim.ns_dtype bfloat16"
  [ns_float32]="--optim.optim.ns_dtype float32"
  [compute_bfloat16]="--runtime.compute_dtype bfloat16"
  [causal]="--model.attention causal"
  [one_thread]="--runtime.num_threads 1"
)
order=(shipped ns_bfloat16 ns_float32 compute_bfloat16 causal one_thread)
[ -n "${VARIANTS:-}" ] && read -r -a order <<<"$VARIANTS"
for name in "${order[@]}"; do
  [ -n "${variant[$name]+set}" ] || { echo "quickstart_bench: unknown variant $name (${!variant[*]})" >&2; exit 2; }
  read -r -a extra <<<"${variant[$name]}"
  echo "== $name: train_fsdp ${base[*]} ${extra[*]}"
  build/apps/train_fsdp "${base[@]}" "${extra[@]}" --logging.metrics_file "$out/$name.jsonl" >"$out/$name.log" 2>&1 \
    || { tail -20 "$out/$name.log"; echo "quickstart_bench: $name failed" >&2; exit 1; }
  grep -E "optimizer muon|device:" "$out/$name.log" | sed 's/^/   /'
done

.venv/bin/python - "$out" "$steps" "${order[@]}" <<'PY'
import json, os, sys
out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
warmup = min(4, steps - 2)
rows = {}
for name in names:
    records = [json.loads(l) for l in open(os.path.join(out, name + ".jsonl"))]
    kept = records[warmup:]
    per_step = (kept[-1]["time"] - kept[0]["time"]) / (len(kept) - 1)
    rows[name] = (per_step, records[-1]["loss"], records[-1].get("attention_kernel"))
shipped = rows.get("shipped", next(iter(rows.values())))[0]
print(f"\nquick start, steps {warmup + 1}..{steps} timed ({out}):")
print("| variant | s/step | x shipped | loss at step %d | attention |" % steps)
print("|---|---|---|---|---|")
for name, (s, loss, kernel) in rows.items():
    print(f"| {name} | {s:.3f} | {s / shipped:.2f} | {loss:.4f} | {kernel} |")
json.dump({n: {"seconds_per_step": s, "over_shipped": s / shipped, "final_loss": l, "attention_kernel": k}
           for n, (s, l, k) in rows.items()}, open(os.path.join(out, "quickstart_bench.json"), "w"), indent=2)
PY
