#!/usr/bin/env bash
# Do our phases reach Nsight as NVTX ranges (profiling.nvtx)? The lent machines have Nsight Compute
# but not Nsight Systems; with --nvtx, ncu prints for each kernel it profiles the NVTX push/pop
# stack of the thread that launched it. One kernel well inside the run (launch 1,500 of the
# debug model's eight steps, a few hundred launches each; with three steps an H100 ran out of
# launches before 1,500 once our fused nodes cut their number) is profiled: its stack must hold
# zb.step and a phase inside it. Exit 0 and "nvtx_check: PASS" when it does.
#
#   scripts/gpu/nvtx_check.sh TRAIN_FSDP CONFIG     # on a machine with a GPU (gpu_check's "nvtx")
set -euo pipefail
[ $# = 2 ] || { echo "usage: $0 TRAIN_FSDP CONFIG" >&2; exit 2; }
train=$1 config=$2
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$ncu" ] || { echo "nvtx_check: no ncu (Nsight Compute) here"; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
rc=0
"$ncu" --nvtx --launch-skip 1500 --launch-count 1 --section LaunchStats \
  "$train" --config "$config" --runtime.device cuda --data.fake --optim.total_steps 8 --ckpt.path "" \
  --wandb false --data.eval_interval 0 --profiling.nvtx true >"$out" 2>&1 || rc=$?
# ncu's report comes after the program has ended ("==PROF== Disconnected"): the profiled kernel,
# its NVTX stack included. The training log before it is left out (it names NVTX itself).
report=$(sed -n '/==PROF== Disconnected/,$p' "$out")
grep -v "^\s*$" <<<"$report" | head -60 || true
[ $rc = 0 ] || { echo "nvtx_check: ncu or the run failed (exit $rc); the end of its output:"; tail -20 "$out"; exit 1; }
# ncu prints the stack one range a line, outermost first, as <depth,name>: on an H200
# (2026-11-26) "<0,zb.step 3>", "<1,zb.clip>", "<2,aten::sqrt>". Any zb. phase counts.
stack=$(sed -n '/NVTX/,$p' <<<"$report")
if grep -q "zb\.step" <<<"$stack" && grep -o -E "zb\.[a-z_.]+" <<<"$stack" | grep -q -v -x "zb\.step"; then
  echo "nvtx_check: PASS (the kernel ran inside zb.step and one of its phases)"
else
  echo "nvtx_check: FAIL: no zb.step range with a phase inside it around the profiled kernel; the end of ncu's output:"
  tail -40 "$out"
  exit 1
fi
