"""What the end-to-end tests share: where the programs are, a scratch folder per test, free ports,
ranks started as torchrun starts them, metrics files and loss comparisons.

ctest runs each test alone, or a module's tests in one process where they share heavy imports
(test_diloco.py; tests/CMakeLists.txt, with ZB_BUILD_DIR set). By hand, from the
repository root:
    ZB_BUILD_DIR=build .venv/bin/python -m pytest tests/e2e/test_launchers.py::test_torchrun

Only the standard library here: every ctest entry starts a fresh pytest, so torch and friends are
imported inside the tests that need them.
"""
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("ZB_BUILD_DIR", SOURCE / "build")).resolve()
CONFIGS = SOURCE / "configs"
DEBUG_CONFIG = CONFIGS / "debug" / "normal.toml"
TRAIN_FSDP = BUILD / "apps" / "train_fsdp"
TRAIN_DDP = BUILD / "apps" / "train_ddp"
TRAIN_HSDP = BUILD / "apps" / "train_hsdp"
EXPORT_HF = BUILD / "apps" / "export_hf"
FAULTY_TRAIN = BUILD / "tests" / "zb_faulty_train"  # tests/faulty_train.cpp: train_fsdp with faults
# The project's environment (ctest runs pytest with it): torchrun, transformers, the tools.
PYTHON = sys.executable
TORCHRUN = Path(PYTHON).parent / "torchrun"
REFERENCE = SOURCE / "tests" / "reference"

# The multi-process tests' run: the debug model narrowed to dim 128 (a quarter of dim 256's time,
# most of which was Newton-Schulz), at 64 tokens, 8 steps. Newton-Schulz in fp32: these tests are
# not about its precision, and bf16 matrix products on a CPU without native bf16 instructions
# (AVX2 only) run about 75 times slower than fp32 ones. 24 sequences per step divide over 1, 2, 3
# and 4 ranks.
SMALL_DIM = 128
SMALL = ["--config", str(DEBUG_CONFIG), "--runtime.device", "cpu", "--runtime.num_threads", "1",
         "--model.dim", str(SMALL_DIM), "--data.seq_length", "64", "--optim.optim.ns_dtype", "float32",
         "--optim.batch_size", "24", "--train.micro_bs", "2", "--optim.warmup_steps", "2", "--optim.total_steps", "8"]


def pytest_sessionfinish(session, exitstatus):
    """Everything skipped (a GPU test without a GPU): exit code 77, which ctest counts as skipped
    where the test sets SKIP_RETURN_CODE 77 and as a failure elsewhere."""
    stats = session.config.pluginmanager.get_plugin("terminalreporter").stats
    if exitstatus == 0 and stats.get("skipped") and not stats.get("passed"):
        session.exitstatus = 77


_started = []  # every process a test started, so that none outlives it


def stop_leftovers():
    for p in _started:
        if p.poll() is None:
            p.kill()
            p.wait()
    _started.clear()


@pytest.fixture(autouse=True)
def _stop_leftover_processes():
    yield
    stop_leftovers()


@pytest.fixture
def work():
    """A scratch folder, removed afterwards (checkpoints are tens of MB), once no process the test
    started writes there."""
    path = Path(tempfile.mkdtemp(prefix="zb_e2e_"))
    yield path
    stop_leftovers()
    shutil.rmtree(path, ignore_errors=True)


_handed_out = set()


def free_port():
    """A port for a store or a service, free now: at random below the kernel's ephemeral range
    (32768 and up, where every connection's own port and every port-0 bind come from, so that none
    of those can take it before the program binds it; one such did, once: EADDRINUSE), and never
    the same twice in a process. Concurrent tests pick from 12,768 ports."""
    while True:
        port = random.randrange(20000, 32768)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


def with_faults(cmd, env):
    """A train_fsdp run given faults (ZB_TEST_* variables) runs the test program that puts them in
    (tests/faulty_train.cpp); the training programs read no such variable."""
    if not any(k.startswith("ZB_TEST_") for k in (env or {})):
        return cmd
    assert Path(cmd[0]) in (TRAIN_FSDP, FAULTY_TRAIN), f"faults go into train_fsdp runs only, not {cmd[0]}"
    return [FAULTY_TRAIN, *cmd[1:]]


def start(cmd, log, env=None, file_limit_kb=None, cwd=None):
    """Starts a program in the background, its stdout and stderr into the file `log`. env adds to
    the environment (ZB_TEST_* faults: with_faults); file_limit_kb is `ulimit -f` (a disk that fills
    up, as the process sees it)."""
    cmd = with_faults(cmd, env)
    def limit():  # in the child, before the program starts
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit_kb * 1024, file_limit_kb * 1024))
    with open(log, "w") as out:
        p = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                             env={**os.environ, **{k: str(v) for k, v in (env or {}).items()}},
                             preexec_fn=limit if file_limit_kb is not None else None)
    _started.append(p)
    return p


def run(*cmd, env=None, cwd=None):
    """Runs a program to its end: (exit code, stdout and stderr together)."""
    cmd = with_faults(cmd, env)
    p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                       env={**os.environ, **{k: str(v) for k, v in (env or {}).items()}})
    return p.returncode, p.stdout


class Ranks:
    """The processes of one run, rank r logging to LOG.r."""

    def __init__(self, procs, log):
        self.procs, self.log = procs, Path(log)

    def wait(self):
        """Each rank's exit code, once every rank has exited."""
        return [p.wait() for p in self.procs]

    def wait_or_stop(self):
        """0 once every rank has exited 0; as under torchrun, the first rank to fail stops the others,
        and its exit code is returned."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                self.kill()
                self.wait()
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)

    def kill(self, sig=signal.SIGKILL):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def text(self, rank=0):
        return Path(f"{self.log}.{rank}").read_text()

    def tails(self, lines=5):
        return "".join(f"\n== {self.log}.{r}\n" + "\n".join(self.text(r).splitlines()[-lines:])
                       for r in range(len(self.procs)))


def start_ranks(world, log, *args, program=TRAIN_FSDP, env=None, limit_rank=None, limit_kb=None):
    """`world` ranks of `program` with torchrun's variables over loopback; rank limit_rank runs
    under `ulimit -f limit_kb`."""
    port = free_port()
    procs = [start([program, *args], f"{log}.{r}", file_limit_kb=limit_kb if r == limit_rank else None,
                   env={**(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": r, "LOCAL_RANK": r,
                        "WORLD_SIZE": world})
             for r in range(world)]
    return Ranks(procs, log)


def run_ranks(world, log, *args, **kwargs):
    """start_ranks, then fails the test unless every rank exits 0 (the first to fail stops the others,
    as torchrun does, rather than leaving them to wait for it)."""
    ranks = start_ranks(world, log, *args, **kwargs)
    code = ranks.wait_or_stop()
    assert code == 0, f"{Path(log).name}: a rank exited with code {code}{ranks.tails()}"
    return ranks


def wait_for(condition, seconds, interval=0.1):
    """Polls until condition() holds: True, or False once `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def text_of(path):
    """A file's text, empty while it does not exist."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def metrics(path):
    """The records of a metrics file (JSON lines)."""
    return [json.loads(line) for line in open(path)]


def by_step(path, key="loss"):
    """{step: record[key]}; where a step appears twice (a resumed run), its last record counts."""
    return {r["step"]: r[key] for r in metrics(path)}


def compare_losses(a, b, rtol, label, first=5, last=8):
    """The losses of steps first..last of metrics file b within rtol of a's (0: bit-identical)."""
    want, got = by_step(a), by_step(b)
    steps = range(first, last + 1)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    print(f"{label}: steps {first}-{last} {[got[s] for s in steps]}, largest relative difference {worst:.2e} "
          f"(allowed {rtol:g})")
    assert worst <= rtol, f"{label}: losses differ"


def digest(folder):
    """One hash of every file of a checkpoint, to show it unchanged."""
    h = hashlib.sha256()
    for f in sorted(os.listdir(folder)):
        h.update(Path(folder, f).read_bytes())
    return h.hexdigest()


def hf_logits_match(folder):
    """transformers' LlamaForCausalLM on an export_hf --check-logits folder gives our logits
    (tests/reference/hf_check.py)."""
    check = subprocess.run([PYTHON, REFERENCE / "hf_check.py", folder], stderr=subprocess.DEVNULL)
    assert check.returncode == 0, "logits differ"
