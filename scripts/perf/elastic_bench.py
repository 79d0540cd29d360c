"""Elastic DiLoCo's costs on the CPU (issue 52): what a lost replica and a joiner cost the others.

For each shape (the debug model, and 70M from the 150M preset at 256 tokens a row), on fake data,
each replica one process of one thread, diloco_peers with --timeout_s T:
  killed  3 replicas; the third is killed (SIGKILL) once it has recorded step 3. Measured: the
          seconds from the kill to the survivors' first step after their new membership, and the
          seconds the membership record says the round lost.
  hung    the same with SIGSTOP: the process stays, its heartbeat stops.
  joiner  2 replicas; a joiner is started once they have recorded step 1. Measured: the seconds
          from its start to its admission and to its first step, and the state it took (bytes,
          seconds), as its log says.

    .venv/bin/python scripts/perf/elastic_bench.py [--timeout 5] [--shapes debug,70M]
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("ZB_BUILD_DIR", ROOT / "build"))
SHAPES = {
    "debug": ["--config", str(ROOT / "configs/debug/normal.toml"), "--data.seq_length", "256"],
    "70M": ["--config", str(ROOT / "configs/150M/H100.toml"), "--name_model", "70M", "--data.seq_length", "256"],
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path):
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except FileNotFoundError:
        return []


def launch(tmp, name, args, env=None):
    log = open(f"{tmp}/{name}.log", "w")
    return subprocess.Popen([str(BUILD / "apps/train_fsdp"), *args, "--logging.metrics_file", f"{tmp}/{name}.jsonl",
                             "--ckpt.path", ""], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def wait_until(condition, seconds=600):
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            raise TimeoutError("the run did not get there")
        time.sleep(0.005)
    return time.time()


def common(shape, port, timeout, steps):
    return [*SHAPES[shape], "--runtime.device", "cpu", "--runtime.num_threads", "1", "--data.fake", "true",
            "--wandb", "false", "--optim.batch_size", "2", "--train.micro_bs", "2", "--optim.total_steps", str(steps),
            "--optim.optim.ns_dtype", "float32", "--diloco.inner_steps", "4", "--diloco.peers", f"127.0.0.1:{port}",
            "--runtime.timeout_s", str(timeout), "--data.eval_interval", "0"]


def lost(shape, timeout, tmp, sig):
    name = signal.Signals(sig).name
    port = free_port()
    peers = subprocess.Popen([str(BUILD / "apps/diloco_peers"), "--port", str(port), "--replicas", "3", "--timeout_s",
                              str(timeout)], stdout=open(f"{tmp}/{name}_peers.log", "w"), stderr=subprocess.STDOUT)
    args = common(shape, port, timeout, 12)
    procs = []
    for r in range(3):
        procs.append(launch(tmp, f"{name}_{r}", args))
        wait_until(lambda: f"replica {r} of the run" in open(f"{tmp}/{name}_{r}.log").read())
    wait_until(lambda: len(records(f"{tmp}/{name}_2.jsonl")) >= 3)
    procs[2].send_signal(sig)
    killed = time.time()
    changed = lambda: [r for r in records(f"{tmp}/{name}_0.jsonl") if r.get("membership", {}).get("generation") == 2]
    wait_until(lambda: changed())
    change = changed()[0]
    step = wait_until(lambda: any(r["step"] == change["step"] + 1 for r in records(f"{tmp}/{name}_0.jsonl")))
    step_seconds = [r["forward_seconds"] + r["backward_seconds"] + r["optimizer_seconds"]
                    for r in records(f"{tmp}/{name}_0.jsonl")]
    for p in procs[:2]:
        p.wait()
    procs[2].kill()
    procs[2].wait()
    peers.wait()
    return {"loss_to_next_step_s": round(step - killed, 2), "round_lost_s": round(change["membership"]["seconds_lost"], 2),
            "step_s": round(sorted(step_seconds)[len(step_seconds) // 2], 3)}


def joiner(shape, timeout, tmp):
    port = free_port()
    peers = subprocess.Popen([str(BUILD / "apps/diloco_peers"), "--port", str(port), "--replicas", "2", "--timeout_s",
                              str(timeout)], stdout=open(f"{tmp}/join_peers.log", "w"), stderr=subprocess.STDOUT)
    args = common(shape, port, timeout, 12)
    procs = [launch(tmp, f"join_{r}", args) for r in range(2)]
    wait_until(lambda: len(records(f"{tmp}/join_0.jsonl")) >= 1)
    started = time.time()
    procs.append(launch(tmp, "joiner", args + ["--diloco.join", "true"]))
    admitted = wait_until(lambda: "admitted at outer step" in open(f"{tmp}/joiner.log").read())
    first = wait_until(lambda: len(records(f"{tmp}/joiner.jsonl")) >= 1)
    for p in procs:
        p.wait()
    peers.wait()
    took = re.search(r"took ([\d,]+) bytes of state .* in ([\d.]+) s; training on after step (\d+)",
                     open(f"{tmp}/joiner.log").read())
    return {"start_to_admission_s": round(admitted - started, 2), "start_to_first_step_s": round(first - started, 2),
            "state_bytes": int(took.group(1).replace(",", "")), "transfer_s": float(took.group(2)),
            "joined_after_step": int(took.group(3))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=int, default=5)
    parser.add_argument("--shapes", default="debug,70M")
    a = parser.parse_args()
    for shape in a.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps({"shape": shape, "timeout_s": a.timeout,
                              "killed": lost(shape, a.timeout, tmp, signal.SIGKILL),
                              "hung": lost(shape, a.timeout, tmp, signal.SIGSTOP),
                              "joiner": joiner(shape, a.timeout, tmp)}), flush=True)


if __name__ == "__main__":
    main()
