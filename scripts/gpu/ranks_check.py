#!/usr/bin/env python3
"""Every layout with several ranks on one device, against the single process (gpu_check.sh's
`ranks` step; on a machine without a GPU, --device cpu runs the same over CPU ranks).

On one GPU the ranks share it: runtime.backend "auto" takes Gloo through host memory (NCCL takes
one rank per GPU), so this checks the engines' CUDA paths (streams, kernels, the casts, the
checkpoint's device copies) with real collectives between processes, not NCCL itself.

The model is the debug preset (configs/debug/normal.toml) at 256 tokens a row: 16 rows a step in
micro-batches of 4, 10 steps, the same fake data. Every layout trains the same global batches, so
each step's loss must equal the single process's up to the order of summation:
  fp32 (compute and Newton-Schulz):  relative 1e-5 at every step (a reordered fp32 sum differs by
      ~1e-7, which ten small steps amplify; a lost or doubled micro-batch moves step 1 by ~1e-2);
  bf16 (the GPU's default):          relative 5e-3: a bf16 value carries 8 bits (2^-8 = 3.9e-3
      relative), and a different split of the batch rounds different partial sums;
  DiLoCo, whose replicas train apart, against the same layout on CPU ranks from the same initial
      weights (the single run's step 5, exported): fp32 1e-5, and 1e-4 with uint8 pseudo-gradients
      (a 1e-7 difference can move a value across one of 256 levels).
Checkpoints: written by 2 GPU ranks, resumed on 1 GPU rank and on 2 CPU ranks; written by 1 GPU
rank and by 2 CPU ranks, resumed on 2 GPU ranks: steps 6-10 against the straight single run (the
CPU-written one against the CPU run that wrote it: a GPU's random initial values are its own).
runtime.deterministic: step 1 of FSDP 2 and DDP 2 bit-identical, and FSDP 2 run twice
bit-identical at every step. Then the DDP-vs-FSDP reproduction (scripts/perf/convergence.sh, 2
ranks, 200 steps on data/python-docs), its largest loss difference printed.

    ranks_check.py OUT [--device cuda|cpu] [--only NAME ...] [--jobs N] [--no-convergence]

Writes OUT/ranks_check.json (each check: ranks, largest relative difference, tolerance, passed)
and OUT/logs/*.log; exit 0 when every check passed, 1 otherwise.
"""
import argparse
import concurrent.futures
import json
import math
import os
import shutil
import subprocess
import threading
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FP32, BF16, DILOCO, DILOCO_UINT8 = 1e-5, 5e-3, 1e-5, 1e-4

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("out")
ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
ap.add_argument("--build", default=str(ROOT / "build"))
ap.add_argument("--python", default=sys.executable, help="a python with torch, for torchrun")
ap.add_argument("--only", nargs="*", help="these checks alone (and the runs they compare with)")
ap.add_argument("--jobs", type=int, default=4, help="runs at once (the GPU and the cores are shared)")
ap.add_argument("--no-convergence", action="store_true")
ap.add_argument("--timeout", type=int, default=180, help="seconds per run")
ap.add_argument("--steps", type=int, default=10, help="steps of every run (the checkpoints need 6 or more)")
args = ap.parse_args()
STEPS = args.steps
out = Path(args.out).resolve()
for old in out.glob("ckpt_*"):
    shutil.rmtree(old)
shutil.rmtree(out / "profile", ignore_errors=True)
(out / "logs").mkdir(parents=True, exist_ok=True)
running = threading.Semaphore(args.jobs)  # training jobs at once
apps = Path(args.build) / "apps"
on_gpu = args.device == "cuda"

COMMON = ["--config", str(ROOT / "configs/debug/normal.toml"), "--data.seq_length", "256", "--train.micro_bs", "4",
          "--optim.total_steps", str(STEPS), "--ckpt.path", "", "--wandb", "false", "--data.eval_interval", "0",
          "--logging.interval", "5", "--optim.optim.ns_dtype", "float32"]
FP32_ARGS = ["--runtime.compute_dtype", "float32"]
ADAMW = ["--optim.optim.type", "adamw"]


def device_args(device):
    return ["--runtime.device", device] + (["--runtime.num_threads", "1"] if device == "cpu" else [])


def train(name, nproc, *extra, program="train_fsdp", device=None):
    """Runs one training job of `nproc` ranks; returns its losses by step (raises on failure)."""
    device = device or args.device
    metrics = out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [str(apps / program), *COMMON, *device_args(device), "--logging.metrics_file", str(metrics), *extra]
    if nproc > 1:
        cmd = [args.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--no-python",
               *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    with running, open(out / "logs" / f"{name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode
    if rc != 0:
        tail = (out / "logs" / f"{name}.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"{name}: exit {rc} after {time.time() - t0:.0f}s\n  " + "\n  ".join(tail))
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def log_has(name, text):
    return text in (out / "logs" / f"{name}.log").read_text()


def compare(a, b, steps=None):
    steps = steps or sorted(set(a) & set(b))
    if not steps or any(s not in a or s not in b for s in steps):
        raise RuntimeError(f"steps missing: {sorted(a)} vs {sorted(b)}")
    for s in steps:
        if not (math.isfinite(a[s]) and math.isfinite(b[s])):
            raise RuntimeError(f"step {s}: loss {a[s]} vs {b[s]}")
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)


results = {}


def record(name, ranks, difference, tolerance, note=""):
    passed = difference <= tolerance
    results[name] = {"ranks": ranks, "largest_relative_difference": difference, "tolerance": tolerance,
                     "passed": passed, "note": note}
    print(f"{'ok  ' if passed else 'FAIL'} {name:28s} {ranks:>7}  largest relative difference {difference:.2e} "
          f"(tolerance {tolerance:.0e}){'  ' + note if note else ''}", flush=True)


def failed(name, error):
    results[name] = {"passed": False, "error": str(error)}
    print(f"FAIL {name}: {error}", flush=True)


# --- the checks ----------------------------------------------------------------------------------
# Each is a function run on a thread of its own; references are futures the checks that need them
# wait on. The semaphore in train() bounds the jobs running at once.
pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)
refs = {}


refs_lock = threading.Lock()  # checks on several threads ask for the same reference run once


def ref(name, nproc, *extra, **kw):
    with refs_lock:
        if name not in refs:
            refs[name] = pool.submit(train, name, nproc, *extra, **kw)
        return refs[name]


def single_fp32():  # also writes the checkpoint at step 5 that 2 ranks resume from
    return ref("single_fp32", 1, *FP32_ARGS, "--ckpt.path", str(out / "ckpt_single"), "--ckpt.interval", "5",
               "--ckpt.keep", "0")


def layout(name, nproc, extra, reference, tolerance, program="train_fsdp", check=None):
    def run():
        losses = train(name, nproc, *extra, program=program)
        note = check(name) if check else ""
        record(name, f"{nproc} {args.device}", compare(losses, reference().result()), tolerance, note)
    return name, run


def collective_line(name):
    """What the start-up said about the backend (auto on one GPU: Gloo through host memory)."""
    text = (out / "logs" / f"{name}.log").read_text()
    for want in ("gloo through host memory", "collectives over gloo", "collectives over nccl"):
        if want in text:
            return want
    raise RuntimeError(f"{name}: no start-up line names the collectives' backend")


def traces(name):
    found = sorted((out / "profile").rglob("rank*_trace.json"))
    if len(found) < 2:
        raise RuntimeError(f"{name}: {len(found)} trace(s) under {out / 'profile'}, expected one per rank")
    return f"{len(found)} traces; {collective_line(name)}"


def shared_init():
    """Initial weights both devices start from (random initial values differ between a GPU and the
    CPU): the single run's step-5 model, exported as a Hugging Face model."""
    with refs_lock:
        if "init" not in refs:
            refs["init"] = pool.submit(export_init)
        return refs["init"]


def export_init():
    single_fp32().result()
    folder = out / "hf_init"
    shutil.rmtree(folder, ignore_errors=True)
    with running, open(out / "logs" / "export_hf.log", "w") as log:
        subprocess.run([str(apps / "export_hf"), str(out / "ckpt_single" / "step_00000005"), str(folder)],
                       stdout=log, stderr=subprocess.STDOUT, check=True, timeout=args.timeout)
    return folder


def diloco(name, extra, tolerance):
    def run():
        init = ["--ckpt.init_from", str(shared_init().result())]
        gpu = pool.submit(train, name, 2, *FP32_ARGS, *init, *extra)
        cpu = train(name + "_cpu", 2, *FP32_ARGS, *init, *extra, device="cpu")
        record(name, f"2 {args.device}", compare(gpu.result(), cpu), tolerance,
               "against the same on 2 CPU ranks, from the same initial weights")
    return name, run


def checkpoints():
    s5 = str(out / "ckpt_single" / "step_00000005")
    after = list(range(6, STEPS + 1))
    straight = single_fp32().result()
    # 2 GPU ranks write; 1 GPU rank and 2 CPU ranks resume.
    two = train("ckpt_2_write", 2, *FP32_ARGS, "--ckpt.path", str(out / "ckpt_two"), "--ckpt.interval", "5",
                "--ckpt.keep", "0")
    record("ckpt_2_write", f"2 {args.device}", compare(two, straight), FP32)
    t5 = str(out / "ckpt_two" / "step_00000005")
    record("ckpt_2_resume_1", f"1 {args.device}",
           compare(train("ckpt_2_resume_1", 1, *FP32_ARGS, "--ckpt.resume", t5), straight, after), FP32)
    if on_gpu:
        record("ckpt_2_resume_cpu2", "2 cpu",
               compare(train("ckpt_2_resume_cpu2", 2, *FP32_ARGS, "--ckpt.resume", t5, device="cpu"), straight, after),
               FP32)
    # 1 GPU rank wrote (the single run); 2 GPU ranks resume. 2 CPU ranks write; 2 GPU ranks resume.
    record("ckpt_1_resume_2", f"2 {args.device}",
           compare(train("ckpt_1_resume_2", 2, *FP32_ARGS, "--ckpt.resume", s5), straight, after), FP32)
    if on_gpu:
        # Against the CPU run's own steps 6-10: its random initial values were the CPU's.
        cpu = train("ckpt_cpu2_write", 2, *FP32_ARGS, "--ckpt.path", str(out / "ckpt_cpu"), "--ckpt.interval", "5",
                    "--ckpt.keep", "0", device="cpu")
        c5 = str(out / "ckpt_cpu" / "step_00000005")
        record("ckpt_cpu2_resume_2", f"2 {args.device}",
               compare(train("ckpt_cpu2_resume_2", 2, *FP32_ARGS, "--ckpt.resume", c5), cpu, after), FP32,
               "against the CPU run that wrote it")


def deterministic():
    det = ["--runtime.deterministic", "true", "--optim.total_steps", "3"]
    fsdp = pool.submit(train, "det_fsdp2", 2, *det)
    again = pool.submit(train, "det_fsdp2_again", 2, *det)
    ddp = train("det_ddp2", 2, *det, program="train_ddp")
    a, b = fsdp.result(), again.result()
    same_run = all(a[s] == b[s] for s in a) and sorted(a) == sorted(b)
    first = a[1] == ddp[1]
    results["deterministic"] = {"passed": same_run and first, "fsdp2": a, "fsdp2_again": b, "ddp2": ddp}
    print(f"{'ok  ' if same_run and first else 'FAIL'} deterministic: FSDP 2 twice bit-identical: {same_run} "
          f"({a} / {b}); step 1 FSDP 2 {a[1]!r} vs DDP 2 {ddp[1]!r}: {'bit-identical' if first else 'differ'}",
          flush=True)


def convergence():
    env = dict(os.environ, OUT=str(out / "convergence"), ZB_SKIP_BUILD="1", PYTHON=args.python,
               BUILD_DIR=args.build)
    extra = [] if on_gpu else ["--runtime.device", "cpu"]
    t0 = time.time()
    with running, open(out / "logs" / "convergence.log", "w") as log:
        rc = subprocess.run([str(ROOT / "scripts/perf/convergence.sh"), str(ROOT / "configs/debug/convergence.toml"),
                             "2", *extra], stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600).returncode
    text = (out / "logs" / "convergence.log").read_text()
    line = next((l for l in text.splitlines() if "largest difference" in l), "")
    ok = rc == 0 and bool(line)
    results["convergence"] = {"passed": ok, "summary": line, "seconds": round(time.time() - t0)}
    if not ok:
        results["convergence"]["error"] = "\n".join(text.splitlines()[-15:])
    print(f"{'ok  ' if ok else 'FAIL'} convergence (DDP vs FSDP, 2 ranks, 200 steps): {line or 'exit %d' % rc}",
          flush=True)


bf16 = lambda: ref("single_bf16", 1, "--runtime.compute_dtype", "bfloat16")  # noqa: E731
adamw = lambda: ref("single_adamw", 1, *FP32_ARGS, *ADAMW)  # noqa: E731
checks = dict([
    layout("fsdp2", 2, FP32_ARGS, single_fp32, FP32, check=collective_line),
    layout("fsdp2_no_reshard", 2, FP32_ARGS + ["--train.reshard_after_forward", "false"], single_fp32, FP32),
    layout("fsdp2_ac", 2, FP32_ARGS + ["--train.ac_ckpt", "true"], single_fp32, FP32),
    layout("fsdp2_reduce_every", 2, FP32_ARGS + ["--train.reduce_every_micro_batch", "true"], single_fp32, FP32),
    layout("fsdp2_keep_unsharded", 2, FP32_ARGS + ["--train.keep_unsharded", "true"], single_fp32, FP32),
    layout("fsdp4", 4, FP32_ARGS, single_fp32, FP32),
    layout("hsdp_2x2", 4, FP32_ARGS + ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2"], single_fp32, FP32),
    layout("tp2_fsdp2", 4, FP32_ARGS + ADAMW + ["--parallel.tp", "2"], adamw, FP32),
    layout("ddp2", 2, FP32_ARGS, single_fp32, FP32, program="train_ddp"),
    layout("profiling", 2, FP32_ARGS + ["--profiling.enable_profiling", "true", "--profiling.profile_freq", "5",
                                        "--profiling.save_traces_folder", str(out / "profile")],
           single_fp32, FP32, check=traces),
    layout("fsdp2_bf16", 2, ["--runtime.compute_dtype", "bfloat16"], bf16, BF16),
    layout("hsdp_2x2_bf16", 4, ["--runtime.compute_dtype", "bfloat16", "--parallel.dp_shard", "2",
                                "--parallel.dp_replicate", "2"], bf16, BF16),
    layout("ddp2_bf16", 2, ["--runtime.compute_dtype", "bfloat16"], bf16, BF16, program="train_ddp"),
    diloco("diloco_uint8", ["--parallel.dp_replicate", "2", "--diloco.inner_steps", "5", "--diloco.compression",
                            "uint8"], DILOCO_UINT8),
    diloco("diloco_streaming", ["--parallel.dp_replicate", "2", "--diloco.inner_steps", "4", "--diloco.fragments",
                                "2", "--diloco.fragment_delay", "1"], DILOCO),
    ("checkpoints", checkpoints),
    ("deterministic", deterministic),
    ("convergence", convergence),
])
if args.no_convergence:
    checks.pop("convergence")
if args.only:
    unknown = set(args.only) - set(checks)
    if unknown:
        sys.exit(f"ranks_check: no check named {', '.join(sorted(unknown))} (known: {', '.join(checks)})")
    checks = {k: v for k, v in checks.items() if k in args.only}

print(f"ranks_check: {len(checks)} checks on {args.device}, {args.jobs} runs at once; logs in {out / 'logs'}",
      flush=True)
started = time.time()
futures = {pool.submit(run): name for name, run in checks.items()}
for f in concurrent.futures.as_completed(futures):
    try:
        f.result()
    except Exception as e:  # noqa: BLE001 - every failure is reported, the others go on
        failed(futures[f], e)
pool.shutdown()
# The logs of what failed, apart (gpu_check.sh brings them back).
shutil.rmtree(out / "failed_logs", ignore_errors=True)
for name, r in results.items():
    if not r["passed"]:
        (out / "failed_logs").mkdir(exist_ok=True)
        for log in (out / "logs").glob(f"*{name}*.log"):
            shutil.copy(log, out / "failed_logs")
        for word in r.get("error", "").split(":")[:1]:  # a run that failed names itself first
            if (out / "logs" / f"{word}.log").exists():
                shutil.copy(out / "logs" / f"{word}.log", out / "failed_logs")
summary = {"device": args.device, "seconds": round(time.time() - started), "checks": results,
           "passed": all(r["passed"] for r in results.values()) and len(results) >= len(checks)}
(out / "ranks_check.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"ranks_check: {sum(r['passed'] for r in results.values())}/{len(results)} passed in {summary['seconds']} s",
      flush=True)
sys.exit(0 if summary["passed"] else 1)
