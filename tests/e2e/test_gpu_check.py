"""The parts of scripts/gpu/gpu_check.sh that need no GPU: argument handling, how it decides to build,
what it does without a GPU, and its report; and gpu_kit.sh's python and toolkit checks. Nothing is
built or trained on a GPU: the script runs from a scratch copy of the tree's layout (its scripts
linked, no build/, no .gpukit/ unless a test makes one), with Debian's packages ignored
(GPU_CHECK_SYSTEM_DEPS=0) and an nvidia-smi that finds no GPU first on PATH."""
import json
import os
import subprocess
import sys

import pytest

from conftest import BUILD, DEBUG_CONFIG, SOURCE, TRAIN_FSDP, run

REPORT_PY = SOURCE / "scripts/gpu/gpu_check_report.py"


class Tree:
    """The scratch tree: root/ (the layout gpu_check.sh expects), bin/ (first on PATH), out/."""

    def __init__(self, tmp):
        self.tmp, self.root, self.bin, self.out = tmp, tmp / "root", tmp / "bin", tmp / "out"
        (self.root / "scripts/gpu").mkdir(parents=True)
        self.bin.mkdir()
        for f in ("gpu_check.sh", "gpu_check_report.py"):
            (self.root / "scripts/gpu" / f).symlink_to(SOURCE / "scripts/gpu" / f)
        self.script("nvidia-smi", 'echo "NVIDIA-SMI has failed (a stand-in: no GPU)" >&2\nexit 9\n')
        self.env = {k: v for k, v in os.environ.items() if k not in ("ZB_SKIP_BUILD", "GPU_CHECK_STEPS")}
        self.env.update(PATH=f"{self.bin}:{os.environ['PATH']}", GPU_CHECK_SYSTEM_DEPS="0")

    def script(self, name, body, folder=None):
        """An executable shell script in bin/ (or folder)."""
        path = (folder or self.bin) / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return path

    def kit(self):
        (self.root / ".gpukit/debs").mkdir(parents=True)
        (self.root / ".gpukit/debs/libspdlog-dev.deb").touch()

    def check(self, *args, **env):
        """gpu_check.sh ARGS: (exit code, stdout, stderr)."""
        p = subprocess.run([self.root / "scripts/gpu/gpu_check.sh", *map(str, args)], capture_output=True, text=True,
                           env={**self.env, **env})
        return p.returncode, p.stdout, p.stderr

    def report(self):
        """The report r, and its steps by name s."""
        r = json.load(open(self.out / "gpu_check.json"))
        return r, {step["name"]: step for step in r["steps"]}


@pytest.fixture
def tree(work):
    return Tree(work)


def test_usage(tree):
    """No argument, two, an unknown option: usage on stderr, nothing on stdout, exit 2, no folder."""
    for args in ([], ["a", "b"], ["--cpu-only"], ["--bogus", tree.tmp / "x"]):
        rc, out, err = tree.check(*args)
        assert rc == 2, f"args {args}: exit {rc}, expected 2"
        assert any(line.startswith("usage: ") and "gpu_check.sh [--cpu-only] OUTDIR" in line
                   for line in err.splitlines()), f"args {args}: no usage on stderr"
        assert not out, f"args {args}: wrote to stdout"
    assert "unknown option --bogus" in err, "unknown option not named"
    assert not (tree.tmp / "x").exists(), "made a folder after a usage error"
    print("usage errors: exit 2")


def test_cpu_only(tree):
    """A kit: it would build with scripts/gpu/gpu_kit.sh build; the GPU parts are not run, exit 0."""
    tree.kit()
    rc, _, err = tree.check("--cpu-only", tree.out / "new")  # the folder is made, parents included
    assert rc == 0, f"--cpu-only with a kit: exit {rc}\n{err}"
    assert sorted(os.listdir(tree.out / "new")) == ["gpu_check.json", "gpu_check.log"], os.listdir(tree.out / "new")
    for f in os.listdir(tree.out / "new"):
        os.rename(tree.out / "new" / f, tree.out / f)
    assert "build: kit" in (tree.out / "gpu_check.log").read_text(), "log"
    r, s = tree.report()
    assert r["mode"] == "cpu-only" and r["build"] == "kit" and r["gpu_parts_ran"] is False, r
    assert r["result"] == "gpu parts not run" and all(x["status"] == "not run" for x in r["steps"]), r
    assert list(s) == ["build", "cuda_tests", "preset_150M", "preset_1B", "profile_1B", "ranks",
                       "preset_1B_deterministic", "preset_150M_det_a", "preset_150M_det_b", "preset_150M_det_resumed",
                       "deterministic_check", "preset_1B_8K_cp1", "preset_1B_8K_cp2_allgather", "preset_1B_8K_cp2_ring",
                       "preset_1B_8K_cp2_varlen", "preset_1B_8K_cp4_allgather", "preset_1B_8K_cp4_ring",
                       "preset_1B_8K_cp4_varlen", "context_check", "preset_1B_8K_speed",
                       "preset_1B_16K_speed", "preset_1B_32K_speed", "preset_1B_float8_off",
                       "preset_1B_float8_tensorwise", "preset_1B_float8_rowwise", "float8_gemms",
                       "preset_7B4_float8_off", "preset_7B4_float8_tensorwise", "float8_quick_bf16",
                       "float8_quick_tensorwise", "float8_check", "moe_debug", "moe_debug_ep2", "moe_experts",
                       "preset_moe_1B_active", "preset_1B_muon_jordan", "preset_1B_muon_polar_express",
                       "preset_1B_muon_qk_clip", "newton_schulz_1B", "newton_schulz_1B_llama3",
                       "preset_1B_muon_gram", "preset_1B_causal",
                       "preset_1B_causal_auto", "preset_1B_cudnn_varlen", "preset_1B_aten", "preset_1B_casts_freed",
                       "preset_1B_unfused_rope", "preset_1B_unfused_gate", "preset_1B_unfused_loss",
                       "preset_1B_unfused_norm", "preset_1B_unfused_linears", "preset_1B_unfused_update",
                       "preset_1B_unfused_momentum", "preset_1B_unfused_residual", "preset_1B_unfused_newton_schulz",
                       "reference_cpu", "reference_gpu_fp32", "reference_gpu_bf16", "reference_check", "nvtx",
                       "bench"] and r["bench"] is None, list(s)
    # A build to use as it is (ZB_SKIP_BUILD=1): "prebuilt", once its GPU side is there too.
    (tree.root / "build/apps").mkdir(parents=True)
    tree.script("train_fsdp", "exit 1\n", tree.root / "build/apps")
    rc, _, err = tree.check("--cpu-only", tree.out, ZB_SKIP_BUILD="1")
    assert rc == 4 and "with its GPU side build/src/libzb_cuda.so to use" in err, \
        f"a build without its GPU plugin: exit {rc}\n{err}"
    (tree.root / "build/src").mkdir(parents=True)
    (tree.root / "build/src/libzb_cuda.so").write_bytes(b"")
    rc, _, err = tree.check("--cpu-only", tree.out, ZB_SKIP_BUILD="1")
    assert rc == 0, f"--cpu-only with ZB_SKIP_BUILD=1: exit {rc}\n{err}"
    assert tree.report()[0]["build"] == "prebuilt"
    print("--cpu-only: kit and prebuilt detected, report says the GPU parts did not run")


def test_no_kit(tree):
    """Neither kit nor Debian packages: exit 4 naming the kit's fetch and the device tool's carry."""
    rc, _, err = tree.check("--cpu-only", tree.out)
    assert rc == 4, f"no kit: exit {rc}, expected 4\n{err}"
    assert "nothing to build with: no .gpukit/debs/*.deb" in err, "no kit: message"
    assert "scripts/gpu/gpu_kit.sh fetch`, then name .gpukit in the device tool's carry" in err, "no kit: remedy"
    r, _ = tree.report()
    assert r["result"] == "no kit" and r["build"] == "none" and "gpu_kit.sh fetch" in r["message"], r
    # ZB_SKIP_BUILD=1 without a build: exit 4 too.
    rc, _, err = tree.check("--cpu-only", tree.out, ZB_SKIP_BUILD="1")
    assert rc == 4 and "ZB_SKIP_BUILD=1 but there is no build/apps/train_fsdp" in err, f"no build: exit {rc}\n{err}"
    print("no kit, no build: exit 4 with the remedy")


def test_no_gpu(tree):
    """A kit but no GPU, not --cpu-only: exit 3 before building anything, a report saying so."""
    tree.kit()
    rc, _, err = tree.check(tree.out)
    assert rc == 3, f"no GPU: exit {rc}, expected 3\n{err}"
    assert "no GPU here (nvidia-smi finds none): the GPU parts did not run" in err, "no GPU: message"
    assert not (tree.root / ".gpukit/root").exists() and not (tree.root / "build").exists(), "built without a GPU"
    r, s = tree.report()
    assert r["mode"] == "gpu" and r["result"] == "gpu parts not run" and r["gpu_parts_ran"] is False, r
    assert s["build"]["status"] == "not run" and s["build"]["note"] == "no GPU" and r["gpu"] is None, r
    print("no GPU: exit 3, nothing built, the report says the GPU parts did not run")


CUDA_TESTS_XML = """<?xml version="1.0" encoding="UTF-8"?>
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
"""
# The profiled 1B steps' summary as train_fsdp writes it on a GPU (its timeline figures).
PROFILE_SUMMARY = {
    "first_step": 7, "last_step": 8, "seconds_per_step": 2.0, "ops_per_step": 90000, "kernels_per_step": 20000,
    "exposed_comm_seconds_per_step": 0.01, "gpu_busy_seconds_per_step": 1.8, "gpu_compute_seconds_per_step": 1.7,
    "gpu_nccl_seconds_per_step": 0.3, "phases": [{"name": "zb.backward", "seconds_per_step": 1.2, "count_per_step": 8}],
    "device_phases": [], "top_ops": [],
    "top_kernels": [{"name": "sm90_xmma_gemm_bf16bf16_bf16f32", "seconds_per_step": 0.9, "count_per_step": 2500}],
    "kernel_kinds": [{"name": "gemm", "seconds_per_step": 1.1, "count_per_step": 3000},
                     {"name": "elementwise", "seconds_per_step": 0.4, "count_per_step": 9000}]}


def test_report(tree):
    """The report from what the GPU steps leave: ctest's JUnit (its format for a pass, a failure and
    a skip), a real metrics file (two CPU steps of the debug preset; MFU is null on a CPU), and a
    bench.json."""
    work = tree.tmp / "work"
    (work / "bench").mkdir(parents=True)
    tree.out.mkdir()
    (work / "steps.tsv").write_text("build\tpassed\t201.5\t\ncuda_tests\tfailed\t40.2\texit 8\n"
                                    "preset_1B\tnot run\t0\tout of time (12s of the budget left)\n")
    (work / "cuda_tests.xml").write_text(CUDA_TESTS_XML)
    rc, out = run(TRAIN_FSDP, "--config", DEBUG_CONFIG, "--runtime.device", "cpu", "--runtime.num_threads", "1",
                  "--data.seq_length", "64", "--optim.batch_size", "4", "--train.micro_bs", "4", "--optim.total_steps",
                  "2", "--optim.optim.ns_dtype", "float32", "--ckpt.path", "",
                  "--logging.metrics_file", work / "preset_150M.jsonl")
    assert rc == 0, f"train_fsdp: {out}"
    # The 1B runs with and without the document mask (flash), causal with PyTorch's kernel, with
    # ATen's operators in place of ours, and with the norm's left to ATen: their copies at 0.97, 1,
    # 1.1, 0.97 / 1.04 and 0.97 / 1.02 of the speed.
    rows = [json.loads(line) for line in open(work / "preset_150M.jsonl")]
    for name, scale in (("1B", 0.97), ("1B_causal", 1.0), ("1B_causal_auto", 1.1), ("1B_aten", 0.97 / 1.04),
                        ("1B_unfused_norm", 0.97 / 1.02)):
        with open(work / f"preset_{name}.jsonl", "w") as f:
            for r in rows:
                if r.get("tokens_per_second"):
                    r = dict(r, tokens_per_second=r["tokens_per_second"] * scale)
                f.write(json.dumps(r) + "\n")
    # The quick start three ways: held-out losses at steps 1 and 2 (a record without one between).
    for name, final in (("cpu", 4.00), ("gpu_fp32", 4.03), ("gpu_bf16", 4.035)):
        with open(work / f"reference_{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(dict(r, val_loss=final + (0.5 if r["step"] == 1 else 0))) + "\n")
            f.write(json.dumps(dict(rows[-1], step=3)) + "\n")
    (work / "bench/bench.json").write_text(
        '{"results": {}, "ratios": {"zeroband-cpp / pytorch-eager": {"tokens_per_second": 1.25}}}\n')
    (work / "profile_1B/iteration_8").mkdir(parents=True)
    (work / "profile_1B/iteration_8/rank0_summary.json").write_text(json.dumps(PROFILE_SUMMARY))
    report = subprocess.run([sys.executable, REPORT_PY, "--work", work, "--out", tree.out / "gpu_check.json", "--set",
                             "mode=gpu", "result=failed", "gpu=NVIDIA H100 80GB HBM3, 81559 MiB, 570.1",
                             "commit=0123456", "cpus=16"], stdout=subprocess.PIPE, text=True, env=tree.env)
    text = report.stdout
    print(text)
    assert report.returncode == 0, f"gpu_check_report.py: {text}"
    r, s = tree.report()
    assert r["gpu_parts_ran"] is True and r["commit"] == "0123456" and r["cpus"] == 16, r
    assert s["cuda_tests"]["status"] == "failed" and s["build"]["seconds"] == 201.5, s
    assert s["preset_1B"]["note"].startswith("out of time"), s
    assert r["tests"]["cuda_tests"] == {"passed": 1, "failed": 1, "skipped": 1,
                                        "failed_tests": ["cuda.CudaNccl.CollectivesInAWorldOfOne"],
                                        "skipped_tests": ["cuda.checkpoint_across_devices"]}, r["tests"]
    p = r["presets"]["150M"]
    assert p["steps"] == 2 and p["final_loss"] > 0 and p["mfu_percent"] is None, p
    assert p["peak_memory_bytes"] > 0 and p["tokens_per_second"] > 0, p
    assert r["bench"]["ratios"]["zeroband-cpp / pytorch-eager"]["tokens_per_second"] == 1.25, r["bench"]
    assert abs(r["document_mask_speed_ratio"] - 0.97) < 1e-9 and abs(r["sdpa_auto_over_flash_speed_ratio"] - 1.1) < 1e-9
    # What the run reported of itself: the kernel it ran, its predicted peak against the measured one.
    assert p["attention_kernel"] in ("flash_attention", "math"), p
    assert p["predicted_peak_memory_bytes"] > 0 and p["peak_over_predicted"] > 0, p
    assert "1B with the document mask / without: tokens/s x 0.970" in text, "mask ratio line"
    assert abs(r["fused_kernels_speed_ratio"] - 1.04) < 1e-9
    assert "1B with our kernels / ATen's operators: tokens/s x 1.040" in text, "kernels ratio line"
    assert list(r["fused_operator_speed_ratios"]) == ["norm"]
    assert abs(r["fused_operator_speed_ratios"]["norm"] - 1.02) < 1e-9
    assert "1B with all of ours / with norm left to ATen: tokens/s x 1.020" in text, "unfused ratio line"
    assert r["profile_1B"]["gpu_busy_seconds_per_step"] == 1.8
    assert ("1B profiled GPU: busy 1.800 s/step (90.0%), compute kernels 1.700, NCCL 0.300 of which 0.100 exposed"
            in text), "profile line"
    assert "0.9000 s/step x2500  sm90_xmma_gemm_bf16bf16_bf16f32" in text, "kernels line"
    assert "1B profiled GPU kernels by kind (s/step): gemm 1.100, elementwise 0.400" in text, "kinds line"
    assert r["reference"]["cpu"]["val_loss"] == {"1": 4.5, "2": 4.0} and \
        r["reference"]["gpu_bf16"]["final_val_loss"] == 4.035, r["reference"]
    assert abs(r["reference_gaps"]["gpu_fp32_minus_cpu"] - 0.03) < 1e-9
    assert abs(r["reference_gaps"]["gpu_bf16_minus_gpu_fp32"] - 0.005) < 1e-9

    def check_reference():
        p = subprocess.run([sys.executable, REPORT_PY, "--work", work, "--check-reference"], stdout=subprocess.PIPE,
                           text=True, env=tree.env)
        return p.returncode, p.stdout
    # The reference check: 1% of the CPU's final loss (0.04 here) holds gaps of 0.03 and 0.035 but
    # not 0.045 (bf16 moved to 4.045), nor a missing run.
    rc, out = check_reference()
    assert rc == 0 and "reference_check: PASS" in out, f"reference check within bounds: {out}"
    bf16 = work / "reference_gpu_bf16.jsonl"
    bf16.write_text(bf16.read_text().replace('"val_loss": 4.035}', '"val_loss": 4.045}'))
    rc, out = check_reference()
    assert rc != 0, f"reference check passed a gap of 0.045: {out}"
    assert "reference_check: FAIL: gpu_bf16_minus_cpu beyond the bound" in out, out
    # A run cut short (its last evaluation at step 1) against the others' step 2.
    bf16.write_text("".join(line for line in bf16.read_text().splitlines(keepends=True) if '"step": 2,' not in line))
    rc, out = check_reference()
    assert rc != 0, f"reference check passed runs ending at different steps: {out}"
    assert "last evaluations are at different steps: cpu step 2, gpu_fp32 step 2, gpu_bf16 step 1" in out, out
    os.rename(work / "reference_gpu_fp32.jsonl", tree.tmp / "reference_gpu_fp32.jsonl")
    rc, out = check_reference()
    assert rc != 0, "reference check passed without the GPU fp32 run"
    assert "reference_check: no held-out loss from gpu_fp32" in out, out
    assert ("quick start, held-out loss at the end: cpu 4.0000, gpu_fp32 4.0300, gpu_bf16 4.0350; gpu_fp32_minus_cpu "
            "+0.0300, gpu_bf16_minus_gpu_fp32 +0.0050, gpu_bf16_minus_cpu +0.0350") in text, "reference line"
    assert "cuda_tests: 1 passed, 1 failed, 1 skipped; failed: cuda.CudaNccl.CollectivesInAWorldOfOne" in text, "summary"


def test_kit_tools(tree):
    """scripts/gpu/gpu_kit.sh on a machine laid out as the lent ones may be: it finds the python that
    has torch (not a python3 without it), and refuses a CUDA toolkit of another major version than
    torch's before unpacking anything. Stand-ins: a python3 without torch, a "torch python" that
    answers the kit's two questions, an nvcc of CUDA 12."""
    (tree.root / "scripts/gpu/gpu_kit.sh").symlink_to(SOURCE / "scripts/gpu/gpu_kit.sh")
    tree.script("python3", "exit 1\n")
    (tree.tmp / "torch/bin").mkdir(parents=True)
    torch_python = tree.script("python3", 'case "$*" in\n  *cmake_prefix_path*) echo /nonexistent ;;\n'
                               '  *torch.version.cuda*) echo 13.0 ;;\nesac\nexit 0\n', tree.tmp / "torch/bin")
    tree.script("nvcc", 'echo "Cuda compilation tools, release 12.4, V12.4.131"\n')
    tree.env["ZB_LENT_PYTHON"] = str(tree.tmp / "no/python3")

    def kit(*args, python, cwd=None):
        p = subprocess.run([tree.root / "scripts/gpu/gpu_kit.sh", *args], capture_output=True, text=True, cwd=cwd,
                           env={**tree.env, "PYTHON": str(python)})
        return p.returncode, p.stdout, p.stderr
    rc, _, err = kit("python", python="")
    assert rc != 0, "found a python with torch where there is none"
    assert "no python with torch" in err, f"no python: {err}"
    rc, _, err = kit("python", python=tree.bin / "python3")
    assert rc != 0, "looked past a PYTHON without torch"
    assert "unset PYTHON to look further" in err, f"PYTHON without torch: {err}"
    rc, out, err = kit("python", python="bin/python3", cwd=tree.tmp / "torch")
    assert rc == 0, f"PYTHON not taken: {err}"
    assert out.strip() == str(torch_python), f"PYTHON as an absolute path: got {out}"
    (tree.root / ".gpukit/debs").mkdir(parents=True)
    rc, _, err = kit("build", python=torch_python)
    assert rc != 0, "built against another CUDA"
    assert f"{tree.bin}/nvcc is CUDA 12.4 but torch was built for CUDA 13.0" in err, f"mismatch: {err}"
    assert not (tree.root / ".gpukit/root").exists(), "unpacked the kit before refusing"
    print("kit: python found, CUDA 12 toolkit for a CUDA 13 torch refused")


def write_losses(path, by_step):
    """A metrics file of one record per step with its loss."""
    path.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in by_step.items()))


def report_check(work, flag):
    """gpu_check_report.py --work WORK FLAG: (exit status, output)."""
    p = subprocess.run([sys.executable, REPORT_PY, "--work", work, flag], stdout=subprocess.PIPE, text=True)
    return p.returncode, p.stdout


def test_deterministic_check(tmp_path):
    """gpu_check's deterministic_check: three 150M runs under runtime.deterministic pass only when
    the rerun equals the first run at every step and the resumed run its last steps, bit for bit."""
    losses = {1: 7.1, 2: 6.9, 3: 6.8, 4: 6.75}
    write = lambda name, by_step: write_losses(tmp_path / f"preset_150M_det_{name}.jsonl", by_step)  # noqa: E731
    check = lambda: report_check(tmp_path, "--check-deterministic")  # noqa: E731
    write("a", losses)
    write("b", losses)
    write("resumed", {3: 6.8, 4: 6.75})
    rc, out = check()
    assert rc == 0 and "150M twice: bit-identical" in out and "resumed at step 5: bit-identical" in out, out
    write("b", {**losses, 3: 6.8 + 1e-7})  # one step off by one part in 7e7
    rc, out = check()
    assert rc == 1 and "150M twice: DIFFERENT (largest difference 1.0" in out, out
    write("b", losses)
    write("resumed", {3: 6.8, 4: 6.7500001})
    rc, out = check()
    assert rc == 1 and "resumed at step 5: DIFFERENT" in out, out


def test_context_check(tmp_path):
    """gpu_check's context_check: each CP run's losses within 5e-3 of the one rank's at every step;
    a run off by more, or with steps missing, fails."""
    losses = {1: 10.8, 2: 10.5, 3: 10.2}
    write = lambda name, by_step: write_losses(tmp_path / f"preset_1B_8K_{name}.jsonl", by_step)  # noqa: E731
    check = lambda: report_check(tmp_path, "--check-context")  # noqa: E731
    write("cp1", losses)
    for name in ("cp2_allgather", "cp2_ring", "cp2_varlen", "cp4_allgather", "cp4_varlen"):
        write(name, {s: v * (1 + 1e-3) for s, v in losses.items()})
    write("cp4_ring", {s: v * (1 - 4e-3) for s, v in losses.items()})
    rc, out = check()
    assert rc == 0 and out.count("PASS") == 6, out
    write("cp4_ring", {s: v * (1 + 6e-3) for s, v in losses.items()})
    rc, out = check()
    assert rc == 1 and "cp 4 ring: largest relative loss difference 6.00e-03 (tolerance 0.005) FAIL" in out, out
    write("cp4_ring", {1: 10.8, 2: 10.5})
    rc, out = check()
    assert rc == 1 and "cp 4 ring: steps [1, 2], the one rank's [1, 2, 3]" in out, out


def test_float8_check(tmp_path):
    """gpu_check's float8_check: the quick start's final held-out loss in FP8 within 1% of bf16's;
    off by more, or cut short, fails; the 1B runs' tokens/s are printed."""
    def write(name, records):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    held_out = lambda losses: [{"step": s, "val_loss": v} for s, v in losses.items()]  # noqa: E731
    write("float8_quick_bf16", held_out({25: 4.4, 150: 3.55}))
    write("float8_quick_tensorwise", held_out({25: 4.45, 150: 3.57}))
    write("preset_1B_float8_tensorwise", [{"step": 20, "loss": 10.2, "tokens_per_second": 98000.0, "mfu": 63.4,
                                           "peak_memory_bytes": 30 * 2**30}])
    rc, out = report_check(tmp_path, "--check-float8")
    assert rc == 0 and "gap +0.0200 (bound 0.0355) PASS" in out and "1B_float8_tensorwise: 98,000 tokens/s" in out, out
    write("float8_quick_tensorwise", held_out({25: 4.45, 150: 3.60}))
    rc, out = report_check(tmp_path, "--check-float8")
    assert rc == 1 and "FAIL" in out, out
    write("float8_quick_tensorwise", held_out({25: 4.45}))
    rc, out = report_check(tmp_path, "--check-float8")
    assert rc == 1 and "cut short" in out, out


def test_ranks_check_on_cpu_ranks(tmp_path):
    """gpu_check's `ranks` step (scripts/gpu/ranks_check.py) runs here over CPU ranks: FSDP on 2
    ranks against the single process, the start-up line naming the backend. What it checks on a
    GPU (every layout sharing the one GPU, the deterministic runs) is the same code with --device
    cuda; every check ran on CPU ranks by hand (2026-11-27)."""
    p = subprocess.run([sys.executable, SOURCE / "scripts/gpu/ranks_check.py", tmp_path, "--device", "cpu",
                        "--build", BUILD, "--only", "fsdp2", "--jobs", "2", "--steps", "3"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    print(p.stdout)
    assert p.returncode == 0, p.stdout
    r = json.loads((tmp_path / "ranks_check.json").read_text())
    fsdp2 = r["checks"]["fsdp2"]
    assert fsdp2["passed"] and fsdp2["ranks"] == "2 cpu" and fsdp2["largest_relative_difference"] <= 1e-5, fsdp2
    assert fsdp2["note"] == "collectives over gloo", fsdp2  # the start-up line names the backend
