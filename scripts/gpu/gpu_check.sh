#!/usr/bin/env bash
# The GPU check, one command for whoever gets a GPU: builds (on a lent machine from the kit that
# scripts/gpu/gpu_kit.sh prepares), runs the CUDA tests (ctest -L cuda), trains the 150M and 1B
# presets for 20 steps on one GPU (1B also with ATen's operators in place of our kernels, all
# and one at a time), records a profile of two 1B steps
# (OUTDIR/profile_1B_summary.json) and benchmarks train_fsdp against PyTorch FSDP2 eager and
# compiled (scripts/perf/bench.sh). Leaves OUTDIR/gpu_check.log (every step's output) and
# OUTDIR/gpu_check.json (what ran, how long, test counts, the presets' tokens/s, MFU and peak
# memory, bench.json), rewritten after each step so that a run cut short still reports.
#
#   scripts/gpu/gpu_check.sh OUTDIR              # on a machine with a GPU
#   scripts/gpu/gpu_check.sh --cpu-only OUTDIR   # argument handling, build detection and the report
#                                            # only: nothing built or run (tests/e2e/test_gpu_check.py)
#
# Building: ZB_SKIP_BUILD=1 uses build/ as it is; else .gpukit/debs (`scripts/gpu/gpu_kit.sh fetch`
# on a machine with a registry, then .gpukit in the device tool's `carry`) builds with
# `scripts/gpu/gpu_kit.sh build`; else Debian's own packages, if installed, with scripts/build.sh.
#
# Exit codes: 0 every step passed (--cpu-only: a build is possible); 1 a step failed, timed out
# or found no time left (the later steps still run); 2 usage; 3 no GPU here: the GPU parts did
# not run (the report says so); 4 nothing to build with.
#
# Time: meant for the device tool's 10-minute command on one H100 with 16 cores. Every step has
# a cap and the whole a budget, GPU_CHECK_BUDGET_S (default 540 s); a step that would start with
# under 30 s left is recorded as not run. Measured (16 cores): the build of the three targets it
# needs 41-64 s cold, the CUDA tests 14-25 s, each preset 10-22 s, the profile 9-11 s, the
# reference 20 s, nvtx 5 s, the benchmark 124-159 s (H100) and 139 s (H200); the whole default
# set 299 s on the H200, 371 s on the H100 with five "unfused" runs (2026-11-26; nine now,
# about 80 s more). The benchmark runs last: it gets what the budget leaves. When
# the build takes the time, run again with ZB_SKIP_BUILD=1 while the machine is warm (it keeps
# build/) and GPU_CHECK_STEPS naming what is left.
#
# Environment: GPU_CHECK_SKIP (step names not to run, e.g. "preset_150M profile_1B"),
# GPU_CHECK_PRESET_STEPS (the presets' steps, default 20; tokens/s is over the last 10),
# ZB_BUILD_TARGETS (the kit builds only these; default what the steps need, all with "suite"),
# GPU_CHECK_STEPS (default "cuda_tests presets ranks deterministic kernels unfused bench reference nvtx":
# "ranks" is every layout with 2-4 ranks sharing the GPU against one process
# (scripts/gpu/ranks_check.py), "deterministic" the 1B preset under runtime.deterministic and three
# 150M runs that must be bit-identical; "context" (not in the default set) the 1B preset at 8K
# tokens a row split over 2 and 4 ranks (parallel.cp, both rotations and runtime.cp_varlen) against
# one rank (3 steps; 7 runs at about 40 s each), and one rank's speed at 8K, 16K and 32K; "float8" (not in the default
# set either) the 1B preset in bf16, tensorwise and rowwise FP8, and the quick start on real text in
# bf16 and FP8; "moe" (not in the default set) the MoE debug preset on one rank and with EP over 2
# ranks sharing the GPU, the experts' GEMMs grouped against a loop, and the ~1B-active preset's MFU; "muon" (not
# in the default set) the 1B preset with Jordan's and Polar Express's coefficients, with QK-clip and
# with Gram Newton-Schulz, and standard against Gram Newton-Schulz alone (apps/bench_newton_schulz); "kernels" is the 1B
# preset again with ATen's operators alone, --runtime.fused_kernels false, what our kernels
# and nodes (RoPE, SwiGLU's gate, the loss's log-sum-exp and logit gradient, RMSNorm's backward
# with the residual's gradient, q/k/v's input gradient summed in the GEMMs, the fp32 updates,
# Muon's momentum, the residual adds in the GEMMs) give in tokens/s and peak memory, and
# "unfused" the 1B preset nine more times, each with one of them left to ATen
# (runtime.unfused), each one's share; "reference" trains the quick start on the CPU in fp32 and
# on the GPU in fp32 and bf16, held-out losses side by side (it needs data/python-docs carried
# along); "nvtx" checks with Nsight Compute that the phases are NVTX ranges,
# scripts/gpu/nvtx_check.sh; add "attention" for the 1B preset without the document mask, flash
# and PyTorch's choice (measured on both cards 2026-11-25/26: the mask x1.010, cuDNN x1.028 over
# flash), and with the mask through cuDNN's attention (runtime.varlen_kernel cudnn), "suite" for
# the rest of ctest), GPU_CHECK_BENCH
# (bench.sh's arguments), GPU_CHECK_PEERS (bench.sh's PEERS, default zeroband),
# GPU_CHECK_BUDGET_S, GPU_CHECK_COMMIT (the
# commit to report where the tree has no .git), GPU_CHECK_SYSTEM_DEPS=0 (ignore Debian packages
# installed here: only the kit or ZB_SKIP_BUILD builds), PYTHON (torch's, for the benchmark's
# peer; default .venv/bin/python, else the python with torch that `gpu_kit.sh python` finds), JOBS.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

usage() {
  echo "usage: $0 [--cpu-only] OUTDIR" >&2
  echo "  runs the GPU check and writes OUTDIR/gpu_check.json and OUTDIR/gpu_check.log (see the script's header)" >&2
  exit 2
}
cpu_only=0
positional=()
for arg in "$@"; do
  case $arg in
    --cpu-only) cpu_only=1 ;;
    -*) echo "$0: unknown option $arg" >&2; usage ;;
    *) positional+=("$arg") ;;
  esac
done
[ ${#positional[@]} -eq 1 ] || usage
mkdir -p "${positional[0]}"
out=$(cd "${positional[0]}" && pwd)
log=$out/gpu_check.log
: >"$log"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
: >"$work/steps.tsv"

budget=${GPU_CHECK_BUDGET_S:-540}
selected=" ${GPU_CHECK_STEPS:-cuda_tests presets ranks deterministic kernels unfused bench reference nvtx} "  # and "attention", "suite"
read -r -a bench_args <<<"${GPU_CHECK_BENCH:-configs/1B/H100.toml 1 15 --train.micro_bs 8 --optim.batch_size 64}"
now() { date +%s.%N; }
started=$(now)
left() { awk -v s="$started" -v n="$(now)" -v b="$budget" 'BEGIN { printf "%d", b - (n - s) }'; }
say() { echo "$*" | tee -a "$log"; }

commit=${GPU_CHECK_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
mode=$([ $cpu_only = 1 ] && echo cpu-only || echo gpu)
gpu="" build_how="" message=""
report() {  # report RESULT: gpu_check.json from what the steps left in $work
  python3 "$ROOT/scripts/gpu/gpu_check_report.py" --work "$work" --out "$out/gpu_check.json" \
    --set mode="$mode" result="$1" message="$message" gpu="$gpu" build="$build_how" commit="$commit" \
    date="$(date -u +%Y-%m-%dT%H:%MZ)" cpus="$(nproc)" budget_seconds="$budget" \
    elapsed_seconds="$(awk -v s="$started" -v n="$(now)" 'BEGIN { printf "%.0f", n - s }')"
}
# record NAME STATUS SECONDS NOTE: one step's outcome.
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$work/steps.tsv"; }
# not_run REASON NAMES...: steps that did not run.
not_run() { local why=$1; shift; for s in "$@"; do record "$s" "not run" 0 "$why"; done; }
# stop CODE RESULT MESSAGE: the report, the message on stderr, exit CODE.
stop() { message=$3; report "$2" >/dev/null; echo "$0: $3" | tee -a "$log" >&2; echo "report: $out/gpu_check.json" >&2; exit "$1"; }

say "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $commit, $mode, budget ${budget}s, output $out"

# How to build. ---------------------------------------------------------------------------------
debian_packages() {  # the Debian packages scripts/setup.sh installs, all present?
  [ "${GPU_CHECK_SYSTEM_DEPS:-1}" != 0 ] || return 1
  local want=(libtomlplusplus-dev libspdlog-dev libfmt-dev libcxxopts-dev nlohmann-json3-dev libgtest-dev libgmock-dev libgloo-dev)
  [ "$(dpkg-query -W -f='${Status}\n' "${want[@]}" 2>/dev/null | grep -c 'install ok installed')" = ${#want[@]} ]
}
unfused_ops=(rope gate loss norm linears update momentum residual newton_schulz)  # kernels/kernel_choices.h's names
# Every step, in the order they run (those of "attention" and "suite" only when asked for).
gpu_steps=(build cuda_tests preset_150M preset_1B profile_1B ranks preset_1B_deterministic preset_150M_det_a
           preset_150M_det_b preset_150M_det_resumed deterministic_check preset_1B_8K_cp1 preset_1B_8K_cp2_allgather
           preset_1B_8K_cp2_ring preset_1B_8K_cp2_varlen preset_1B_8K_cp4_allgather preset_1B_8K_cp4_ring
           preset_1B_8K_cp4_varlen context_check preset_1B_8K_speed
           preset_1B_16K_speed preset_1B_32K_speed preset_1B_float8_off preset_1B_float8_tensorwise
           preset_1B_float8_rowwise float8_gemms preset_7B4_float8_off preset_7B4_float8_tensorwise
           float8_quick_bf16 float8_quick_tensorwise float8_check moe_debug moe_debug_ep2 moe_experts preset_moe_1B_active
           preset_1B_muon_jordan preset_1B_muon_polar_express preset_1B_muon_qk_clip newton_schulz_1B
           newton_schulz_1B_llama3 preset_1B_muon_gram
           preset_1B_causal preset_1B_causal_auto preset_1B_cudnn_varlen
           preset_1B_aten preset_1B_casts_freed
           "${unfused_ops[@]/#/preset_1B_unfused_}" reference_cpu reference_gpu_fp32 reference_gpu_bf16
           reference_check nvtx bench)
if [ "${ZB_SKIP_BUILD:-0}" = 1 ]; then
  build_how=prebuilt
  [ -x "$ROOT/build/apps/train_fsdp" ] && [ -f "$ROOT/build/src/libzb_cuda.so" ] || { build_how=none;
    not_run "nothing to build with" "${gpu_steps[@]}";
    stop 4 "no build" "ZB_SKIP_BUILD=1 but there is no build/apps/train_fsdp with its GPU side build/src/libzb_cuda.so to use"; }
elif compgen -G "$ROOT/.gpukit/debs/*.deb" >/dev/null; then
  build_how=kit
elif debian_packages; then
  build_how=system
else
  build_how=none
  not_run "nothing to build with" "${gpu_steps[@]}"
  stop 4 "no kit" "nothing to build with: no .gpukit/debs/*.deb (the kit) and not Debian's packages either. On a machine with a package registry run \`scripts/gpu/gpu_kit.sh fetch\`, then name .gpukit in the device tool's carry (or build there first and use ZB_SKIP_BUILD=1)"
fi
say "build: $build_how"
# Programs built with the kit load spdlog and fmt from it (scripts/gpu/gpu_kit.sh), the build's own
# test discovery included.
if [ "$build_how" = kit ] || { [ "$build_how" = prebuilt ] && [ -d "$ROOT/.gpukit/root" ]; }; then
  export LD_LIBRARY_PATH=$ROOT/.gpukit/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # The kit's Python packages (unpacked by gpu_kit.sh build): muon-fsdp2 for the benchmark's peer,
  # pytest for the end-to-end tests.
  export PYTHONPATH=$ROOT/.gpukit/pylib${PYTHONPATH:+:$PYTHONPATH}
fi

if [ $cpu_only = 1 ]; then
  not_run "--cpu-only" "${gpu_steps[@]}"
  message="--cpu-only: nothing built or run; the build would use: $build_how"
  report "gpu parts not run" | tee -a "$log"
  exit 0
fi
if ! gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1) || [ -z "$gpu" ]; then
  gpu=""
  not_run "no GPU" "${gpu_steps[@]}"
  stop 3 "gpu parts not run" "no GPU here (nvidia-smi finds none): the GPU parts did not run (--cpu-only checks the rest)"
fi
say "gpu: $gpu"

# The steps. ------------------------------------------------------------------------------------
failed=0
# step NAME CAP COMMAND...: runs COMMAND (output to the log) for at most CAP seconds, or what is
# left of the budget; records passed / failed / timed out; rewrites the report.
step() {
  local name=$1 cap=$2; shift 2
  local remaining rc=0 t0 took status note=""
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    record "$name" "not run" 0 "in GPU_CHECK_SKIP"; say "== $name: not run (GPU_CHECK_SKIP)"; return 0
  fi
  remaining=$(left)
  if [ "$remaining" -lt 30 ]; then
    record "$name" "not run" 0 "out of time (${remaining}s of the budget left)"
    say "== $name: not run, out of time"; failed=1; report running >/dev/null || true; return 0
  fi
  [ "$cap" -gt $((remaining - 5)) ] && cap=$((remaining - 5))
  { echo; echo "== $name (at most ${cap}s): $*"; } >>"$log"
  t0=$(now)
  timeout -k 10 "$cap" "$@" >>"$log" 2>&1 || rc=$?
  took=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  if [ $rc = 0 ]; then status=passed
  elif [ $rc = 124 ] || [ $rc = 137 ]; then status="timed out"; note="after ${cap}s"; failed=1
  else status=failed; note="exit $rc"; failed=1; fi
  record "$name" "$status" "$took" "$note"
  say "== $name: $status in ${took}s${note:+ ($note)}"
  report running >/dev/null 2>>"$log" || say "   (the report could not be written: see the end of the log)"
}
wanted() { [[ "$selected" == *" $1 "* ]]; }

python=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" ||
                  "$ROOT/scripts/gpu/gpu_kit.sh" python 2>>"$log" || echo python3)}
say "python: $python"
# torch.compile's Triton builds its launchers against Python's headers: without them the peers
# run eager only (the report's bench then has no compiled rows).
peer_compile=1
if ! "$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  peer_compile=0
  say "   no Python.h for $python: the benchmark's peers run eager only"
fi
case $build_how in
  # What the steps run, unless the whole suite is wanted (ZB_BUILD_TARGETS set, even empty, wins).
  kit) targets="train_fsdp zb_cuda zb_cuda_tests zb_comm_bytes"; wanted ranks && targets+=" train_ddp export_hf"
       wanted muon && targets+=" bench_newton_schulz"
       wanted suite && targets=""
       step build 360 env JOBS="${JOBS:-$(nproc)}" ZB_BUILD_TARGETS="${ZB_BUILD_TARGETS-$targets}" \
         "$ROOT/scripts/gpu/gpu_kit.sh" build ;;
  system) step build 360 env JOBS="${JOBS:-$(nproc)}" "$ROOT/scripts/build.sh" ;;
  prebuilt) record build "not run" 0 "ZB_SKIP_BUILD=1: build/ as it is" ;;
esac
cd "$ROOT"
train=(build/apps/train_fsdp --runtime.device cuda --data.fake --optim.total_steps "${GPU_CHECK_PRESET_STEPS:-20}" --ckpt.path "" --wandb false
       --data.eval_interval 0 --logging.interval 10)
one_b=(--config configs/1B/H100.toml --optim.batch_size 64)  # every 1B step: 2 micro-batches of 32
if wanted cuda_tests; then
  step cuda_tests 150 ctest --test-dir build -L cuda --output-on-failure --timeout 300 --output-junit "$work/cuda_tests.xml"
  # On a GPU a skipped CUDA test is a failure: CUDA did not see the device.
  if grep -q 'status="notrun"' "$work/cuda_tests.xml" 2>/dev/null; then
    say "   some CUDA tests skipped on a GPU machine (see the log)"; failed=1
  fi
else not_run "not in GPU_CHECK_STEPS" cuda_tests; fi
if wanted presets; then
  # The presets as configured but for the global batch (128 and 64 sequences: the presets' 512 and
  # 1024 would take 4 and 16 times as long): their own micro-batches (64 and 32 sequences; the
  # estimate gives 30.5 and 52.4 GiB, which an H100 holds).
  step preset_150M 100 "${train[@]}" --config configs/150M/H100.toml --optim.batch_size 128 \
    --logging.metrics_file "$work/preset_150M.jsonl"
  step preset_1B 150 "${train[@]}" "${one_b[@]}" \
    --logging.metrics_file "$work/preset_1B.jsonl"
  # A short trace of the 1B preset (steps 7 and 8 of 8, after the warm-up): where a step's time
  # goes, the kernels it launches; the summary and the trace (compressed) come back.
  step profile_1B 90 "${train[@]}" "${one_b[@]}" \
    --optim.total_steps 8 --profiling.enable_profiling true --profiling.profile_freq 8 --profiling.profile_active 2 \
    --profiling.save_traces_folder "$work/profile_1B" --logging.metrics_file "$work/profile_1B.jsonl"
  cp "$work/profile_1B/iteration_8/rank0_summary.json" "$out/profile_1B_summary.json" 2>/dev/null || true
  # The trace itself, compressed, for reading the timeline after the machine is gone (the device
  # tool brings back files of up to 16 MB; a larger one stays behind, said in the log).
  if [ -f "$work/profile_1B/iteration_8/rank0_trace.json" ]; then
    gzip -c "$work/profile_1B/iteration_8/rank0_trace.json" >"$out/profile_1B_trace.json.gz" || true
    if [ "$(stat -c %s "$out/profile_1B_trace.json.gz" 2>/dev/null || echo 0)" -gt $((15 << 20)) ]; then
      say "   the 1B trace compressed is over 15 MB: not kept"; rm -f "$out/profile_1B_trace.json.gz"
    fi
  fi
else not_run "not in GPU_CHECK_STEPS" preset_150M preset_1B profile_1B; fi
if wanted ranks; then
  # Every layout with 2-4 ranks sharing the GPU against the single process, checkpoints across
  # rank counts and devices, runtime.deterministic's bit-identical first steps, and the DDP-vs-FSDP
  # reproduction (scripts/gpu/ranks_check.py; it needs data/python-docs carried along).
  step ranks 300 "$python" "$ROOT/scripts/gpu/ranks_check.py" "$work/ranks" --build build --python "$python"
  # Its verdicts and the logs of what failed come back (the metrics and checkpoints stay behind).
  cp "$work/ranks/ranks_check.json" "$out/" 2>/dev/null || true
  [ -d "$work/ranks/failed_logs" ] && { rm -rf "$out/ranks_failed_logs"; cp -r "$work/ranks/failed_logs" "$out/ranks_failed_logs"; }
else not_run "not in GPU_CHECK_STEPS" ranks; fi
if wanted deterministic; then
  # runtime.deterministic: what it costs the 1B preset (against preset_1B), and two straight 150M
  # runs and one resumed at step 5 of the first, bit-identical at every step (the check).
  step preset_1B_deterministic 150 "${train[@]}" "${one_b[@]}" --runtime.deterministic true \
    --logging.metrics_file "$work/preset_1B_deterministic.jsonl"
  det=("${train[@]}" --config configs/150M/H100.toml --optim.batch_size 64 --optim.total_steps 10 --runtime.deterministic true)
  step preset_150M_det_a 90 "${det[@]}" --ckpt.path "$work/det_ckpt" --ckpt.interval 5 \
    --logging.metrics_file "$work/preset_150M_det_a.jsonl"
  step preset_150M_det_b 90 "${det[@]}" --logging.metrics_file "$work/preset_150M_det_b.jsonl"
  step preset_150M_det_resumed 90 "${det[@]}" --ckpt.resume "$work/det_ckpt/step_00000005" \
    --logging.metrics_file "$work/preset_150M_det_resumed.jsonl"
  step deterministic_check 30 python3 "$ROOT/scripts/gpu/gpu_check_report.py" --work "$work" --check-deterministic
else not_run "not in GPU_CHECK_STEPS" preset_1B_deterministic preset_150M_det_a preset_150M_det_b \
  preset_150M_det_resumed deterministic_check; fi
if wanted context; then
  # Context parallelism: the 1B preset on one row of 8192 tokens (micro-batch 1, 3 steps) on one
  # rank, and split over 2 and 4 ranks sharing the GPU (parallel.cp, allgather and ring), the losses
  # against the one rank's (gpu_check_report.py --check-context). Ranks sharing a GPU talk through
  # Gloo in host memory, about 10 s a step here (H100, 2026-11-27): the CP runs check numerics, not
  # speed. Then one rank's tokens/s at 8K, 16K and 32K tokens a row (attention's share grows).
  long=("${train[@]}" --config configs/1B/H100.toml --data.seq_length 8192 --train.micro_bs 1 --optim.batch_size 1
        --optim.total_steps 3 --logging.interval 1)
  step preset_1B_8K_cp1 90 "${long[@]}" --logging.metrics_file "$work/preset_1B_8K_cp1.jsonl"
  for cp in 2 4; do
    for rotate in allgather ring varlen; do
      how=(--parallel.cp_rotate "$rotate"); [ "$rotate" = varlen ] && how=(--runtime.cp_varlen true)
      step "preset_1B_8K_cp${cp}_$rotate" 90 "$python" -m torch.distributed.run --standalone --nproc_per_node "$cp" \
        --no-python "${long[@]}" --parallel.cp "$cp" "${how[@]}" \
        --logging.metrics_file "$work/preset_1B_8K_cp${cp}_$rotate.jsonl"
    done
  done
  step context_check 30 python3 "$ROOT/scripts/gpu/gpu_check_report.py" --work "$work" --check-context
  for len in 8192 16384 32768; do
    step "preset_1B_$((len / 1024))K_speed" 90 "${long[@]}" --data.seq_length "$len" --optim.batch_size $((32768 / len * 2)) \
      --optim.total_steps 6 --logging.interval 3 --logging.metrics_file "$work/preset_1B_$((len / 1024))K_speed.jsonl"
  done
else not_run "not in GPU_CHECK_STEPS" preset_1B_8K_cp1 preset_1B_8K_cp2_allgather preset_1B_8K_cp2_ring \
  preset_1B_8K_cp2_varlen preset_1B_8K_cp4_allgather preset_1B_8K_cp4_ring preset_1B_8K_cp4_varlen context_check preset_1B_8K_speed preset_1B_16K_speed preset_1B_32K_speed; fi
if wanted float8; then
  # Float8 linears (float8/float8.h): the 1B preset in bf16, then with tensorwise and rowwise FP8
  # (tokens/s, MFU in bf16's FLOPs, peak memory: the report's presets); the quick start on real
  # text in bf16 and in tensorwise FP8 on the GPU, the final held-out losses within 1%
  # (gpu_check_report.py --check-float8; it needs data/python-docs carried along). The FP8 GEMMs
  # against their emulation are a CUDA test (cuda_tests).
  for recipe in off tensorwise rowwise; do
    f8=(); [ "$recipe" = off ] || f8=(--float8.enable_float8_linear true --float8.recipe_name "$recipe")
    step "preset_1B_float8_$recipe" 150 "${train[@]}" "${one_b[@]}" "${f8[@]}" \
      --logging.metrics_file "$work/preset_1B_float8_$recipe.jsonl"
  done
  # The projections' GEMMs alone (1B and 7B shapes), and the 7B preset's blocks (4 of them, its
  # micro-batches of 4 x 2048) in bf16 and tensorwise FP8: where FP8's tensor cores pay.
  step float8_gemms 90 "$python" "$ROOT/scripts/perf/float8_gemms.py" --train build/apps/train_fsdp \
    --config configs/1B/H100.toml configs/7B/H100.toml --out "$out/float8_gemms.json"
  for recipe in off tensorwise; do
    f8=(); [ "$recipe" = off ] || f8=(--float8.enable_float8_linear true)
    step "preset_7B4_float8_$recipe" 120 "${train[@]}" --config configs/7B/H100.toml --model.n_layers 4 \
      --optim.batch_size 16 "${f8[@]}" --logging.metrics_file "$work/preset_7B4_float8_$recipe.jsonl"
  done
  if [ -f data/python-docs/val/shard_000000.bin ]; then
    quick=(build/apps/train_fsdp --config configs/debug/quickstart.toml --ckpt.path "" --wandb false --runtime.device cuda)
    step float8_quick_bf16 60 "${quick[@]}" --logging.metrics_file "$work/float8_quick_bf16.jsonl"
    step float8_quick_tensorwise 60 "${quick[@]}" --float8.enable_float8_linear true \
      --logging.metrics_file "$work/float8_quick_tensorwise.jsonl"
    step float8_check 30 python3 "$ROOT/scripts/gpu/gpu_check_report.py" --work "$work" --check-float8
  else
    not_run "no data/python-docs here (scripts/setup.sh makes it; carry it)" float8_quick_bf16 \
      float8_quick_tensorwise float8_check
    failed=1
  fi
else not_run "not in GPU_CHECK_STEPS" preset_1B_float8_off preset_1B_float8_tensorwise preset_1B_float8_rowwise \
  float8_gemms preset_7B4_float8_off preset_7B4_float8_tensorwise float8_quick_bf16 float8_quick_tensorwise \
  float8_check; fi
if wanted moe; then
  # A mixture of experts (model/moe.h) on the GPU: the debug preset's blocks in bf16 through the
  # grouped GEMM (tokens/s, memory; the CUDA tests compare its numbers with the CPU's), and the
  # experts' GEMMs alone, grouped against one product per expert, at the MoE shapes users train.
  step moe_debug 60 "${train[@]}" --config configs/moe/debug.toml --logging.metrics_file "$work/preset_moe_debug.jsonl"
  # The same with expert parallelism over 2 ranks sharing the GPU (Gloo through host memory): its
  # losses beside one rank's, and what the exchanges cost.
  step moe_debug_ep2 90 "$python" -m torch.distributed.run --standalone --nproc_per_node 2 --no-python "${train[@]}" \
    --config configs/moe/debug.toml --parallel.ep 2 --logging.metrics_file "$work/preset_moe_debug_ep2.jsonl"
  step moe_experts 60 "$python" "$ROOT/scripts/perf/moe_experts_cpu.py" --device cuda
  # The ~1B-active preset on one GPU: MFU of its active parameters, and its peak against the estimate.
  step preset_moe_1B_active 150 "${train[@]}" --config configs/moe/1B-active_H100.toml \
    --logging.metrics_file "$work/preset_moe_1B_active.jsonl"
else not_run "not in GPU_CHECK_STEPS" moe_debug moe_debug_ep2 moe_experts preset_moe_1B_active; fi
if wanted muon; then
  # Muon at scale (optim/muon.h, parallel/qk_clip.h): the 1B preset with today's Newton-Schulz
  # coefficients, with Polar Express's, and with those, the attention logits' watch and QK-clip at
  # Kimi K2's threshold (what the watch and the clip cost a step; the logits it logs).
  step preset_1B_muon_jordan 150 "${train[@]}" "${one_b[@]}" --logging.metrics_file "$work/preset_1B_muon_jordan.jsonl"
  step preset_1B_muon_polar_express 150 "${train[@]}" "${one_b[@]}" --optim.optim.ns_coefficients polar_express \
    --logging.metrics_file "$work/preset_1B_muon_polar_express.jsonl"
  step preset_1B_muon_qk_clip 150 "${train[@]}" "${one_b[@]}" --optim.optim.ns_coefficients polar_express \
    --optim.optim.qk_clip_threshold 100 --logging.metrics_file "$work/preset_1B_muon_qk_clip.jsonl"
  # Gram Newton-Schulz (optim.optim.ns_algorithm): standard in bf16 against Gram in fp16 on the 1B
  # presets' matrices, every block's in one batch as Muon takes them (llama2 with Jordan's
  # coefficients, llama3 with Polar Express's); then the 1B preset with it (its step time against
  # preset_1B_muon_jordan's).
  step newton_schulz_1B 60 "$ROOT/build/apps/bench_newton_schulz" --model 1B --layers 18 --device cuda --repeats 10
  step newton_schulz_1B_llama3 60 "$ROOT/build/apps/bench_newton_schulz" --model 1B --type_model llama3 --layers 18 \
    --device cuda --repeats 10 --coefficients polar_express
  step preset_1B_muon_gram 150 "${train[@]}" "${one_b[@]}" --optim.optim.ns_algorithm gram \
    --logging.metrics_file "$work/preset_1B_muon_gram.jsonl"
else not_run "not in GPU_CHECK_STEPS" preset_1B_muon_jordan preset_1B_muon_polar_express preset_1B_muon_qk_clip \
  newton_schulz_1B newton_schulz_1B_llama3 preset_1B_muon_gram; fi
if wanted attention; then
  # The same without the document mask, on the dense flash kernel (the family the document path
  # runs): what masking costs (the report gives the ratio). Then with PyTorch's own choice of
  # kernel (cuDNN's attention on the H200, 2026-11-25, x1.03 over flash; auto is the default).
  step preset_1B_causal 150 "${train[@]}" "${one_b[@]}" \
    --model.attention causal --runtime.sdpa_backend flash --logging.metrics_file "$work/preset_1B_causal.jsonl"
  step preset_1B_causal_auto 150 "${train[@]}" "${one_b[@]}" \
    --model.attention causal --runtime.sdpa_backend auto --logging.metrics_file "$work/preset_1B_causal_auto.jsonl"
  # The document mask again, by cuDNN's attention over the same lengths (runtime.varlen_kernel).
  step preset_1B_cudnn_varlen 150 "${train[@]}" "${one_b[@]}" \
    --runtime.varlen_kernel cudnn --logging.metrics_file "$work/preset_1B_cudnn_varlen.jsonl"
else not_run "not in GPU_CHECK_STEPS" preset_1B_causal preset_1B_causal_auto preset_1B_cudnn_varlen; fi
if wanted kernels; then
  # The 1B preset as preset_1B ran it, with ATen's operators in place of our kernels and nodes.
  step preset_1B_aten 150 "${train[@]}" "${one_b[@]}" \
    --runtime.fused_kernels false --logging.metrics_file "$work/preset_1B_aten.jsonl"
  # And with the casts freed and made again as resharding asks (train.keep_unsharded false; the
  # preset's run keeps them where they fit, "auto").
  step preset_1B_casts_freed 150 "${train[@]}" "${one_b[@]}" \
    --train.keep_unsharded false --logging.metrics_file "$work/preset_1B_casts_freed.jsonl"
else not_run "not in GPU_CHECK_STEPS" preset_1B_aten preset_1B_casts_freed; fi
if wanted unfused; then
  # The 1B preset with one of our operators left to ATen at a time (runtime.unfused): each one's share.
  for op in "${unfused_ops[@]}"; do
    step "preset_1B_unfused_$op" 150 "${train[@]}" "${one_b[@]}" \
      --runtime.unfused "$op" --logging.metrics_file "$work/preset_1B_unfused_$op.jsonl"
  done
else not_run "not in GPU_CHECK_STEPS" "${unfused_ops[@]/#/preset_1B_unfused_}"; fi
if wanted reference; then
  # The quick start's model on real text (data/python-docs: scripts/setup.sh makes it here; name
  # it in the device tool's carry) three ways: on this machine's CPU in fp32 (the reference), on
  # the GPU in fp32 and in bf16. Held-out losses side by side: GPU fp32 against the CPU is the
  # device alone (its random initial values, its kernels), bf16 against GPU fp32 the precision.
  if [ -f data/python-docs/val/shard_000000.bin ]; then
    quick=(build/apps/train_fsdp --config configs/debug/quickstart.toml --ckpt.path "" --wandb false)
    step reference_cpu 150 "${quick[@]}" --runtime.device cpu --logging.metrics_file "$work/reference_cpu.jsonl"
    step reference_gpu_fp32 60 "${quick[@]}" --runtime.device cuda --runtime.compute_dtype float32 \
      --logging.metrics_file "$work/reference_gpu_fp32.jsonl"
    step reference_gpu_bf16 60 "${quick[@]}" --runtime.device cuda --runtime.compute_dtype bfloat16 \
      --logging.metrics_file "$work/reference_gpu_bf16.jsonl"
    # The final held-out losses within 1% of the CPU's (gpu_check_report.py's REFERENCE_TOLERANCE).
    step reference_check 30 python3 "$ROOT/scripts/gpu/gpu_check_report.py" --work "$work" --check-reference
  else
    not_run "no data/python-docs here (scripts/setup.sh makes it; carry it)" reference_cpu reference_gpu_fp32 \
      reference_gpu_bf16 reference_check
    failed=1
  fi
else not_run "not in GPU_CHECK_STEPS" reference_cpu reference_gpu_fp32 reference_gpu_bf16 reference_check; fi
if wanted nvtx; then
  # The phases as NVTX ranges, seen by Nsight Compute around one kernel (the debug model).
  step nvtx 90 scripts/gpu/nvtx_check.sh build/apps/train_fsdp configs/debug/normal.toml
else not_run "not in GPU_CHECK_STEPS" nvtx; fi
if wanted bench; then
  # The peer with ZeroBand's own Muon only (GPU_CHECK_PEERS="zeroband torch" adds torch.optim.Muon's,
  # if the budget allows: each peer runs eager and compiled). The peers' flex attention compiles
  # without max-autotune (ZeroBand's PRIME_DEBUG): its search could take minutes of the budget.
  # Without torch.compile (no Python.h) flex attention cannot be fused: the peers take the document
  # mask as a dense one through SDPA instead.
  step bench 270 env OUT="$work/bench" BENCH_COMMIT="$commit" PYTHON="$python" PEER_COMPILE=$peer_compile ZB_SKIP_BUILD=1 PEERS="${GPU_CHECK_PEERS:-zeroband}" \
    PRIME_DEBUG="${PRIME_DEBUG-1}" PEER_MASK="${PEER_MASK:-$([ $peer_compile = 1 ] && echo auto || echo sdpa)}" \
    scripts/perf/bench.sh "${bench_args[@]}"
  for f in "$work"/bench/*.log; do  # each side's own output, which bench.sh keeps apart
    [ -f "$f" ] && { echo; echo "== $(basename "$f"), its last 60 lines"; tail -n 60 "$f"; } >>"$log"
  done
else not_run "not in GPU_CHECK_STEPS" bench; fi
if wanted suite; then
  step suite 300 ctest --test-dir build -LE cuda -j "$(nproc)" --timeout 300 --output-junit "$work/suite.xml"
fi

message=$([ $failed = 0 ] && echo "every step passed" || echo "some steps failed, timed out or did not run: see the log")
echo >>"$log"
report "$([ $failed = 0 ] && echo passed || echo failed)" | tee -a "$log"
exit $failed
