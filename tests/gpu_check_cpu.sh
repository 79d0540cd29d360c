#!/usr/bin/env bash
# The parts of scripts/gpu/gpu_check.sh that need no GPU: argument handling, how it decides to build,
# what it does without a GPU, and its report. Nothing is built or trained on a GPU: the script
# runs from a scratch copy of the tree's layout (its scripts linked, no build/, no .gpukit/
# unless a case makes one), with Debian's packages ignored (GPU_CHECK_SYSTEM_DEPS=0) and an
# nvidia-smi that finds no GPU first on PATH.
#   gpu_check_cpu.sh usage|cpu_only|no_kit|no_gpu|report|kit_tools TRAIN_FSDP CONFIG
set -u
what=$1 train=$2 config=$3
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root
mkdir -p "$root/scripts/gpu" "$tmp/bin"
ln -s "$src/scripts/gpu/gpu_check.sh" "$src/scripts/gpu/gpu_check_report.py" "$root/scripts/gpu/"
printf '#!/bin/sh\necho "NVIDIA-SMI has failed (a stand-in: no GPU)" >&2\nexit 9\n' >"$tmp/bin/nvidia-smi"
chmod +x "$tmp/bin/nvidia-smi"
export PATH=$tmp/bin:$PATH GPU_CHECK_SYSTEM_DEPS=0
unset ZB_SKIP_BUILD GPU_CHECK_STEPS
check=$root/scripts/gpu/gpu_check.sh
fail() { echo "FAIL: $*"; for f in "$tmp"/*.err "$tmp"/out/gpu_check.log; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done; exit 1; }
# run NAME ARGS...: the script, its exit code in $rc, stdout and stderr in $tmp/NAME.out / .err.
run() { local name=$1; shift; "$check" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"; rc=$?; }
# report EXPR: a Python assertion on the report r (and its steps by name, s).
report() {
  python3 - "$tmp/out/gpu_check.json" "$1" <<'PY' || fail "report: $1"
import json, sys
r = json.load(open(sys.argv[1]))
s = {step["name"]: step for step in r["steps"]}
assert eval(sys.argv[2]), json.dumps(r, indent=1)
PY
}

case $what in
usage)
  # No argument, two, an unknown option: usage on stderr, nothing on stdout, exit 2, no folder.
  for args in "" "a b" "--cpu-only" "--bogus $tmp/x"; do
    run usage $args
    [ $rc = 2 ] || fail "args '$args': exit $rc, expected 2"
    grep -q "^usage: .*gpu_check.sh \[--cpu-only\] OUTDIR" "$tmp/usage.err" || fail "args '$args': no usage on stderr"
    [ -s "$tmp/usage.out" ] && fail "args '$args': wrote to stdout"
  done
  grep -q "unknown option --bogus" "$tmp/usage.err" || fail "unknown option not named"
  [ -e "$tmp/x" ] && fail "made a folder after a usage error"
  echo "usage errors: exit 2"
  ;;
cpu_only)
  # A kit: it would build with scripts/gpu/gpu_kit.sh build; the GPU parts are not run, exit 0.
  mkdir -p "$root/.gpukit/debs" && : >"$root/.gpukit/debs/libspdlog-dev.deb"
  run cpu_only --cpu-only "$tmp/out/new"  # the folder is made, parents included
  [ $rc = 0 ] || fail "--cpu-only with a kit: exit $rc"
  [ "$(ls "$tmp/out/new" | tr '\n' ' ')" = "gpu_check.json gpu_check.log " ] || fail "left $(ls "$tmp/out/new")"
  mv "$tmp/out/new/"* "$tmp/out/"
  grep -q "build: kit" "$tmp/out/gpu_check.log" || fail "log"
  report 'r["mode"] == "cpu-only" and r["build"] == "kit" and r["gpu_parts_ran"] is False'
  report 'r["result"] == "gpu parts not run" and all(x["status"] == "not run" for x in r["steps"])'
  report 'list(s) == ["build", "cuda_tests", "preset_150M", "preset_1B", "profile_1B", "preset_1B_causal", "preset_1B_causal_auto", "preset_1B_cudnn_varlen", "preset_1B_aten", "preset_1B_casts_freed", "preset_1B_unfused_rope", "preset_1B_unfused_gate", "preset_1B_unfused_loss", "preset_1B_unfused_norm", "preset_1B_unfused_linears", "preset_1B_unfused_update", "preset_1B_unfused_momentum", "preset_1B_unfused_residual", "preset_1B_unfused_newton_schulz", "reference_cpu", "reference_gpu_fp32", "reference_gpu_bf16", "reference_check", "nvtx", "bench"] and r["bench"] is None'
  # A build to use as it is (ZB_SKIP_BUILD=1): "prebuilt".
  mkdir -p "$root/build/apps" && printf '#!/bin/sh\nexit 1\n' >"$root/build/apps/train_fsdp" && chmod +x "$root/build/apps/train_fsdp"
  ZB_SKIP_BUILD=1 run cpu_only --cpu-only "$tmp/out"
  [ $rc = 0 ] || fail "--cpu-only with ZB_SKIP_BUILD=1: exit $rc"
  report 'r["build"] == "prebuilt"'
  echo "--cpu-only: kit and prebuilt detected, report says the GPU parts did not run"
  ;;
no_kit)
  # Neither kit nor Debian packages: exit 4 naming the kit's fetch and the device tool's carry.
  run no_kit --cpu-only "$tmp/out"
  [ $rc = 4 ] || fail "no kit: exit $rc, expected 4"
  grep -q 'nothing to build with: no .gpukit/debs/\*.deb' "$tmp/no_kit.err" || fail "no kit: message"
  grep -q 'scripts/gpu/gpu_kit.sh fetch`, then name .gpukit in the device tool.s carry' "$tmp/no_kit.err" || fail "no kit: remedy"
  report 'r["result"] == "no kit" and r["build"] == "none" and "gpu_kit.sh fetch" in r["message"]'
  # ZB_SKIP_BUILD=1 without a build: exit 4 too.
  ZB_SKIP_BUILD=1 run no_build --cpu-only "$tmp/out"
  [ $rc = 4 ] && grep -q "ZB_SKIP_BUILD=1 but there is no build/apps/train_fsdp" "$tmp/no_build.err" || fail "no build: exit $rc"
  echo "no kit, no build: exit 4 with the remedy"
  ;;
no_gpu)
  # A kit but no GPU, not --cpu-only: exit 3 before building anything, a report saying so.
  mkdir -p "$root/.gpukit/debs" && : >"$root/.gpukit/debs/libspdlog-dev.deb"
  run no_gpu "$tmp/out"
  [ $rc = 3 ] || fail "no GPU: exit $rc, expected 3"
  grep -q "no GPU here (nvidia-smi finds none): the GPU parts did not run" "$tmp/no_gpu.err" || fail "no GPU: message"
  [ -e "$root/.gpukit/root" ] || [ -e "$root/build" ] && fail "built without a GPU"
  report 'r["mode"] == "gpu" and r["result"] == "gpu parts not run" and r["gpu_parts_ran"] is False'
  report 's["build"]["status"] == "not run" and s["build"]["note"] == "no GPU" and r["gpu"] is None'
  echo "no GPU: exit 3, nothing built, the report says the GPU parts did not run"
  ;;
report)
  # The report from what the GPU steps leave: ctest's JUnit (its format for a pass, a failure
  # and a skip), a real metrics file (two CPU steps of the debug preset; MFU is null on a CPU),
  # and a bench.json.
  work=$tmp/work && mkdir -p "$work/bench" "$tmp/out"
  printf 'build\tpassed\t201.5\t\ncuda_tests\tfailed\t40.2\texit 8\npreset_1B\tnot run\t0\tout of time (12s of the budget left)\n' >"$work/steps.tsv"
  cat >"$work/cuda_tests.xml" <<'XML'
<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="(empty)" tests="3" failures="1" disabled="0" skipped="1" hostname="" time="3">
	<testcase name="cuda.CudaModel.Bf16ForwardBackwardMatchesFp32OnCpu" classname="cuda.CudaModel.Bf16ForwardBackwardMatchesFp32OnCpu" time="2.1" status="run">
	</testcase>
	<testcase name="cuda.CudaNccl.CollectivesInAWorldOfOne" classname="cuda.CudaNccl.CollectivesInAWorldOfOne" time="0.5" status="fail">
		<failure message="Failed"/>
	</testcase>
	<testcase name="cuda.checkpoint_across_devices" classname="cuda.checkpoint_across_devices" time="0.1" status="notrun">
		<skipped message="SKIP_RETURN_CODE=77"/>
	</testcase>
</testsuite>
XML
  "$train" --config "$config" --runtime.device cpu --runtime.num_threads 1 --data.seq_length 64 \
    --optim.batch_size 4 --train.micro_bs 4 --optim.total_steps 2 --optim.optim.ns_dtype float32 --ckpt.path "" \
    --logging.metrics_file "$work/preset_150M.jsonl" >"$tmp/train.err" 2>&1 || fail "train_fsdp: $(cat "$tmp/train.err")"
  # The 1B runs with and without the document mask (flash), causal with PyTorch's kernel, with
  # ATen's operators in place of ours, and with the norm's left to ATen: their copies at 0.97, 1,
  # 1.1, 0.97 / 1.04 and 0.97 / 1.02 of the speed.
  python3 - "$work" <<'PY' || fail "copies"
import json, os, sys
rows = [json.loads(line) for line in open(os.path.join(sys.argv[1], "preset_150M.jsonl"))]
for name, scale in (("1B", 0.97), ("1B_causal", 1.0), ("1B_causal_auto", 1.1), ("1B_aten", 0.97 / 1.04),
                    ("1B_unfused_norm", 0.97 / 1.02)):
    with open(os.path.join(sys.argv[1], f"preset_{name}.jsonl"), "w") as f:
        for r in rows:
            if r.get("tokens_per_second"):
                r = dict(r, tokens_per_second=r["tokens_per_second"] * scale)
            f.write(json.dumps(r) + "\n")
# The quick start three ways: held-out losses at steps 1 and 2 (a record without one between).
for name, final in (("cpu", 4.00), ("gpu_fp32", 4.03), ("gpu_bf16", 4.035)):
    with open(os.path.join(sys.argv[1], f"reference_{name}.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(dict(r, val_loss=final + (0.5 if r["step"] == 1 else 0))) + "\n")
        f.write(json.dumps(dict(rows[-1], step=3)) + "\n")
PY
  echo '{"results": {}, "ratios": {"zeroband-cpp / pytorch-eager": {"tokens_per_second": 1.25}}}' >"$work/bench/bench.json"
  # The profiled 1B steps' summary as train_fsdp writes it on a GPU (its timeline figures).
  mkdir -p "$work/profile_1B/iteration_8"
  cat >"$work/profile_1B/iteration_8/rank0_summary.json" <<'JSON'
{"first_step": 7, "last_step": 8, "seconds_per_step": 2.0, "ops_per_step": 90000, "kernels_per_step": 20000,
 "exposed_comm_seconds_per_step": 0.01, "gpu_busy_seconds_per_step": 1.8, "gpu_compute_seconds_per_step": 1.7,
 "gpu_nccl_seconds_per_step": 0.3, "phases": [{"name": "zb.backward", "seconds_per_step": 1.2, "count_per_step": 8}],
 "device_phases": [], "top_ops": [],
 "top_kernels": [{"name": "sm90_xmma_gemm_bf16bf16_bf16f32", "seconds_per_step": 0.9, "count_per_step": 2500}],
 "kernel_kinds": [{"name": "gemm", "seconds_per_step": 1.1, "count_per_step": 3000},
                  {"name": "elementwise", "seconds_per_step": 0.4, "count_per_step": 9000}]}
JSON
  python3 "$src/scripts/gpu/gpu_check_report.py" --work "$work" --out "$tmp/out/gpu_check.json" \
    --set mode=gpu result=failed gpu="NVIDIA H100 80GB HBM3, 81559 MiB, 570.1" commit=0123456 cpus=16 >"$tmp/report.out" \
    || fail "gpu_check_report.py: $(cat "$tmp/report.out")"
  cat "$tmp/report.out"
  report 'r["gpu_parts_ran"] is True and r["commit"] == "0123456" and r["cpus"] == 16'
  report 's["cuda_tests"]["status"] == "failed" and s["build"]["seconds"] == 201.5 and s["preset_1B"]["note"].startswith("out of time")'
  report 'r["tests"]["cuda_tests"] == {"passed": 1, "failed": 1, "skipped": 1, "failed_tests": ["cuda.CudaNccl.CollectivesInAWorldOfOne"], "skipped_tests": ["cuda.checkpoint_across_devices"]}'
  report 'r["presets"]["150M"]["steps"] == 2 and r["presets"]["150M"]["final_loss"] > 0 and r["presets"]["150M"]["mfu_percent"] is None'
  report 'r["presets"]["150M"]["peak_memory_bytes"] > 0 and r["presets"]["150M"]["tokens_per_second"] > 0'
  report 'r["bench"]["ratios"]["zeroband-cpp / pytorch-eager"]["tokens_per_second"] == 1.25'
  report 'abs(r["document_mask_speed_ratio"] - 0.97) < 1e-9 and abs(r["sdpa_auto_over_flash_speed_ratio"] - 1.1) < 1e-9'
  # What the run reported of itself: the kernel it ran, its predicted peak against the measured one.
  report 'r["presets"]["150M"]["attention_kernel"] in ("flash_attention", "math")'
  report 'r["presets"]["150M"]["predicted_peak_memory_bytes"] > 0 and r["presets"]["150M"]["peak_over_predicted"] > 0'
  grep -q "1B with the document mask / without: tokens/s x 0.970" "$tmp/report.out" || fail "mask ratio line"
  report 'abs(r["fused_kernels_speed_ratio"] - 1.04) < 1e-9'
  grep -q "1B with our kernels / ATen's operators: tokens/s x 1.040" "$tmp/report.out" || fail "kernels ratio line"
  report 'list(r["fused_operator_speed_ratios"]) == ["norm"] and abs(r["fused_operator_speed_ratios"]["norm"] - 1.02) < 1e-9'
  grep -q "1B with all of ours / with norm left to ATen: tokens/s x 1.020" "$tmp/report.out" || fail "unfused ratio line"
  report 'r["profile_1B"]["gpu_busy_seconds_per_step"] == 1.8'
  grep -q "1B profiled GPU: busy 1.800 s/step (90.0%), compute kernels 1.700, NCCL 0.300 of which 0.100 exposed" \
    "$tmp/report.out" || fail "profile line"
  grep -q "0.9000 s/step x2500  sm90_xmma_gemm_bf16bf16_bf16f32" "$tmp/report.out" || fail "kernels line"
  grep -q "1B profiled GPU kernels by kind (s/step): gemm 1.100, elementwise 0.400" "$tmp/report.out" || fail "kinds line"
  report 'r["reference"]["cpu"]["val_loss"] == {"1": 4.5, "2": 4.0} and r["reference"]["gpu_bf16"]["final_val_loss"] == 4.035'
  report 'abs(r["reference_gaps"]["gpu_fp32_minus_cpu"] - 0.03) < 1e-9 and abs(r["reference_gaps"]["gpu_bf16_minus_gpu_fp32"] - 0.005) < 1e-9'
  # The reference check: 1% of the CPU's final loss (0.04 here) holds gaps of 0.03 and 0.035 but
  # not 0.045 (bf16 moved to 4.045), nor a missing run.
  python3 "$src/scripts/gpu/gpu_check_report.py" --work "$work" --check-reference >"$tmp/check.out" \
    || fail "reference check within bounds: $(cat "$tmp/check.out")"
  grep -q "reference_check: PASS" "$tmp/check.out" || fail "reference check: $(cat "$tmp/check.out")"
  sed -i 's/"val_loss": 4.035}/"val_loss": 4.045}/' "$work/reference_gpu_bf16.jsonl"
  python3 "$src/scripts/gpu/gpu_check_report.py" --work "$work" --check-reference >"$tmp/check.out" \
    && fail "reference check passed a gap of 0.045: $(cat "$tmp/check.out")"
  grep -q "reference_check: FAIL: gpu_bf16_minus_cpu beyond the bound" "$tmp/check.out" || fail "$(cat "$tmp/check.out")"
  # A run cut short (its last evaluation at step 1) against the others' step 2.
  grep -v '"step": 2,' "$work/reference_gpu_bf16.jsonl" >"$tmp/short.jsonl" && cp "$tmp/short.jsonl" "$work/reference_gpu_bf16.jsonl"
  python3 "$src/scripts/gpu/gpu_check_report.py" --work "$work" --check-reference >"$tmp/check.out" \
    && fail "reference check passed runs ending at different steps: $(cat "$tmp/check.out")"
  grep -q "last evaluations are at different steps: cpu step 2, gpu_fp32 step 2, gpu_bf16 step 1" "$tmp/check.out" \
    || fail "$(cat "$tmp/check.out")"
  mv "$work/reference_gpu_fp32.jsonl" "$tmp/"
  python3 "$src/scripts/gpu/gpu_check_report.py" --work "$work" --check-reference >"$tmp/check.out" \
    && fail "reference check passed without the GPU fp32 run"
  grep -q "reference_check: no held-out loss from gpu_fp32" "$tmp/check.out" || fail "$(cat "$tmp/check.out")"
  grep -q "quick start, held-out loss at the end: cpu 4.0000, gpu_fp32 4.0300, gpu_bf16 4.0350; gpu_fp32_minus_cpu +0.0300, gpu_bf16_minus_gpu_fp32 +0.0050, gpu_bf16_minus_cpu +0.0350" \
    "$tmp/report.out" || fail "reference line"
  grep -q "cuda_tests: 1 passed, 1 failed, 1 skipped; failed: cuda.CudaNccl.CollectivesInAWorldOfOne" "$tmp/report.out" || fail "summary"
  ;;
kit_tools)
  # scripts/gpu/gpu_kit.sh on a machine laid out as the lent ones may be: it finds the python that
  # has torch (not a python3 without it), and refuses a CUDA toolkit of another major version than
  # torch's before unpacking anything. Stand-ins: a python3 without torch, a "torch python" that
  # answers the kit's two questions, an nvcc of CUDA 12.
  ln -s "$src/scripts/gpu/gpu_kit.sh" "$root/scripts/gpu/"
  kit=$root/scripts/gpu/gpu_kit.sh
  printf '#!/bin/sh\nexit 1\n' >"$tmp/bin/python3"
  mkdir -p "$tmp/torch/bin"
  cat >"$tmp/torch/bin/python3" <<'SH'
#!/bin/sh
case "$*" in
  *cmake_prefix_path*) echo /nonexistent ;;
  *torch.version.cuda*) echo 13.0 ;;
esac
exit 0
SH
  printf '#!/bin/sh\necho "Cuda compilation tools, release 12.4, V12.4.131"\n' >"$tmp/bin/nvcc"
  chmod +x "$tmp/bin/python3" "$tmp/torch/bin/python3" "$tmp/bin/nvcc"
  export ZB_LENT_PYTHON=$tmp/no/python3
  PYTHON= "$kit" python >"$tmp/py.out" 2>"$tmp/py.err" && fail "found a python with torch where there is none"
  grep -q "no python with torch" "$tmp/py.err" || fail "no python: $(cat "$tmp/py.err")"
  PYTHON=$tmp/bin/python3 "$kit" python >"$tmp/py.out" 2>"$tmp/py.err" && fail "looked past a PYTHON without torch"
  grep -q "unset PYTHON to look further" "$tmp/py.err" || fail "PYTHON without torch: $(cat "$tmp/py.err")"
  (cd "$tmp/torch" && PYTHON=bin/python3 "$kit" python) >"$tmp/py.out" 2>"$tmp/py.err" || fail "PYTHON not taken"
  [ "$(cat "$tmp/py.out")" = "$tmp/torch/bin/python3" ] || fail "PYTHON as an absolute path: got $(cat "$tmp/py.out")"
  mkdir -p "$root/.gpukit/debs"
  PYTHON=$tmp/torch/bin/python3 "$kit" build >"$tmp/build.out" 2>"$tmp/build.err" && fail "built against another CUDA"
  grep -q "$tmp/bin/nvcc is CUDA 12.4 but torch was built for CUDA 13.0" "$tmp/build.err" || fail "mismatch: $(cat "$tmp/build.err")"
  [ -e "$root/.gpukit/root" ] && fail "unpacked the kit before refusing"
  echo "kit: python found, CUDA 12 toolkit for a CUDA 13 torch refused"
  ;;
*)
  echo "unknown case $what"; exit 2 ;;
esac
echo PASS
