"""A checkpoint saved by a run on the GPU resumes on the CPU, and one saved there resumes on the GPU:
checkpoints hold fp32 rows on the host whatever the device. Skipped (exit code 77: ctest counts it
as skipped) where there is no GPU; scripts/gpu/gpu_check.sh runs it on one (ctest -L cuda)."""
import subprocess

import pytest

from conftest import SMALL, compare_losses, run_ranks


def have_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def test_checkpoint_across_devices(work):
    """One process; fp32 compute on both devices (bf16 on the GPU would differ from the CPU by far
    more than a broken resume does), so the runs differ only by the devices' fp32 kernels (summation
    order; LibTorch leaves TF32 off). Steps 1-4 on the GPU, saved; 5-8 on the CPU from that
    checkpoint, saving at 6; 7-8 on the GPU again from the CPU's step 6. Each resumed run's first
    loss is a forward pass of the loaded weights on the same batch: within 1e-4 of the straight GPU
    run's. The later ones also depend on the loaded optimizer state: within 1e-3."""
    if not have_gpu():
        pytest.skip("no GPU here (nvidia-smi -L fails)")
    fp32 = [*SMALL, "--runtime.compute_dtype", "float32", "--ckpt.keep", "0"]
    run_ranks(1, work / "gpu.log", *fp32, "--runtime.device", "cuda", "--ckpt.path", work / "gpu", "--ckpt.interval",
              "4", "--logging.metrics_file", work / "gpu.jsonl")
    cpu = run_ranks(1, work / "cpu.log", *fp32, "--runtime.device", "cpu", "--ckpt.path", work / "cpu",
                    "--ckpt.interval", "2", "--ckpt.resume", work / "gpu/step_00000004",
                    "--logging.metrics_file", work / "cpu.jsonl")
    assert "resumed from" in cpu.text(0), "the CPU run did not resume"
    back = run_ranks(1, work / "back.log", *fp32, "--runtime.device", "cuda", "--ckpt.path", work / "back",
                     "--ckpt.resume", work / "cpu/step_00000006", "--logging.metrics_file", work / "back.jsonl")
    assert "resumed from" in back.text(0), "the GPU run did not resume"
    compare_losses(work / "gpu.jsonl", work / "cpu.jsonl", 1e-4, "saved on the GPU, resumed on the CPU", 5, 5)
    compare_losses(work / "gpu.jsonl", work / "cpu.jsonl", 1e-3, "saved on the GPU, resumed on the CPU", 5, 8)
    compare_losses(work / "gpu.jsonl", work / "back.jsonl", 1e-4, "saved on the CPU, resumed on the GPU", 7, 7)
    compare_losses(work / "gpu.jsonl", work / "back.jsonl", 1e-3, "saved on the CPU, resumed on the GPU", 7, 8)
