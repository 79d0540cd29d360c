#!/usr/bin/env python3
"""Sends a run's metrics (the JSON lines train_fsdp and train_ddp write) to TensorBoard and to
Weights & Biases, live while the run trains or after the fact. Training never waits for it:
with `wandb = true` or `logging.tensorboard_dir` in the config, rank 0 starts it on its own
metrics file (`--follow --pid`) and goes on.

  follow_metrics.py outputs/run/metrics.jsonl --tensorboard runs/tb      # a finished run, once
  follow_metrics.py outputs/run/metrics.jsonl --wandb --follow           # live, until the last step

Every number of a step record becomes a scalar at that step: loss, val_loss, lr/<group>,
grad_norm, tokens_per_second, mfu, peak_memory_bytes, the phase times, comm_bytes/<collective>,
and the rest. TensorBoard gets them as float64 (read back exactly); W&B as its history, under
the config's `project`, named after the metrics file's directory, with the resolved run (the
<stem>.config.json train_fsdp writes beside metrics file <stem>.jsonl) as the run's config. W&B
runs offline (files under the metrics directory, `wandb sync` uploads them) when
WANDB_MODE=offline, when there are no credentials, or when its server (WANDB_BASE_URL, else
api.wandb.ai) cannot be reached. Each metrics file is its own W&B run; with --resumed (the
trainer passes it when it resumed) the run continues the one recorded in <stem>.wandb_id.

With --follow it waits for the file to appear and for new lines, and stops at the run's final
step (schedule.total_steps of the config, or --total-steps; with --follow only a record written
after the follower started counts, as a resumed run's file already holds earlier ones), when
the --pid process has ended, after --idle-timeout seconds without a new record, or on SIGTERM;
it closes its outputs cleanly in every case. Steps a resumed run repeats are sent again to
TensorBoard (which keeps both); W&B keeps the first, as it takes steps in increasing order.
"""
import argparse
import json
import os
import signal
import socket
import sys
import time
import urllib.parse
import uuid


console = None  # --console-fd: the trainer's stderr, where warnings also go


def warn(text):
    line = f"follow_metrics: warning: {text}"
    print(line, file=sys.stderr, flush=True)
    if console:
        console.write(line + "\n")
        console.flush()


def scalars(record):
    """The record's numbers, nested ones by path ("lr/muon"), without the step and the nulls."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else k, v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix] = value

    walk("", {k: v for k, v in record.items() if k != "step"})
    return out


def records(path, follow, pid, total_steps, idle_timeout, on_idle=None, poll=0.5):
    """Yields the file's records in order; with `follow`, as they are written. `on_idle` is
    called whenever the reader has caught up with the file."""
    f, pending, last_new = None, "", time.monotonic()
    # With --follow, what the file already holds is a resumed run's past: its final step is not
    # this run's end.
    final_from = os.path.getsize(path) if follow and os.path.exists(path) else 0
    read = 0  # bytes of complete lines handed out
    while True:
        if f is None and os.path.exists(path):
            f = open(path)
        chunk = f.read() if f else ""
        if chunk:
            pending += chunk
            *lines, pending = pending.split("\n")  # a line still being written stays pending
            for line in lines:
                read += len(line.encode()) + 1
                if not line.strip():
                    continue
                record = json.loads(line)
                yield record
                if total_steps and record.get("step", 0) >= total_steps and read > final_from:
                    return
            last_new = time.monotonic()
            continue
        if on_idle:
            on_idle()
        if not follow:
            return
        if pid and not process_alive(pid):
            follow = False  # one more read for what it wrote last, then stop
            continue
        if idle_timeout and time.monotonic() - last_new > idle_timeout:
            warn(f"no new record in {idle_timeout:.0f} s; stopping")
            return
        time.sleep(poll)  # a file read to its end returns what is appended on the next read


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TensorBoardSink:
    def __init__(self, logdir):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=logdir, flush_secs=10)

    def send(self, step, values):
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, global_step=step, new_style=True, double_precision=True)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


def wandb_mode():
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    url = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    netrc = os.path.expanduser("~/.netrc")
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (
        os.path.exists(netrc) and host in open(netrc, errors="replace").read())
    if not has_key:
        return "offline"
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "online"
    except OSError:
        return "offline"


class WandbSink:
    def __init__(self, wandb, project, name, run_dir, config, id_file, resumed):
        mode = wandb_mode()
        self.last_step = 0
        # One W&B run per metrics file; a resumed training continues the one it started.
        run_id = open(id_file).read().strip() if resumed and os.path.exists(id_file) else uuid.uuid4().hex[:16]
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=run_dir,
                              config=config, mode=mode)
        with open(id_file, "w") as f:
            f.write(run_id + "\n")
        print(f"follow_metrics: W&B run {name} ({run_id}) in project {project} ({mode})", flush=True)

    def send(self, step, values):
        if step > self.last_step:
            self.run.log(values, step=step)
            self.last_step = step

    def flush(self):
        pass  # wandb sends in the background

    def close(self):
        self.run.finish()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="the run's metrics.jsonl")
    ap.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files into DIR")
    ap.add_argument("--wandb", action="store_true", help="send to Weights & Biases")
    ap.add_argument("--project", help="W&B project (default: the config's `project`)")
    ap.add_argument("--name", help="W&B run name (default: the metrics file's directory)")
    ap.add_argument("--config", help="the resolved run (default: <stem>.config.json beside <stem>.jsonl)")
    ap.add_argument("--resumed", action="store_true", help="the run resumed: continue its W&B run")
    ap.add_argument("--follow", action="store_true", help="wait for the file and for new records")
    ap.add_argument("--pid", type=int, default=0, help="with --follow: stop once this process has ended")
    ap.add_argument("--total-steps", type=int, default=0, help="the final step (default: from the config)")
    ap.add_argument("--console-fd", type=int, help="also write warnings to this file descriptor")
    ap.add_argument("--idle-timeout", type=float, default=0, help="with --follow: stop after this many "
                    "seconds without a record (default: never)")
    args = ap.parse_args()
    if not args.tensorboard and not args.wandb:
        ap.error("nothing to send to: give --tensorboard DIR and/or --wandb")
    global console
    if args.console_fd:
        try:
            console = os.fdopen(args.console_fd, "w")
        except OSError:
            pass
    os.environ.setdefault("WANDB_SILENT", "true")  # its progress lines are not ours to print

    run_dir = os.path.dirname(os.path.abspath(args.metrics))
    stem = os.path.splitext(os.path.abspath(args.metrics))[0]
    config_path = args.config or stem + ".config.json"
    if args.follow and not args.config:  # the trainer writes it as it starts
        deadline = time.monotonic() + 60
        while not os.path.exists(config_path) and time.monotonic() < deadline and (
                not args.pid or process_alive(args.pid)):
            time.sleep(0.5)
    config = json.load(open(config_path)) if os.path.exists(config_path) else {}
    total_steps = args.total_steps or config.get("schedule", {}).get("total_steps", 0)

    sinks = []
    if args.tensorboard:
        try:
            sinks.append(TensorBoardSink(args.tensorboard))
        except ImportError as e:
            warn(f"TensorBoard is not installed for {sys.executable} ({e}); not writing {args.tensorboard}")
    if args.wandb:
        try:
            import wandb
        except ImportError:
            wandb = None
            warn(f"wandb is not installed for {sys.executable}; not sending to Weights & Biases "
                 "(pip install wandb, or set wandb = false)")
        if wandb is not None:
            project = args.project or config.get("project") or "zeroband-cpp"
            try:
                sinks.append(WandbSink(wandb, project, args.name or os.path.basename(run_dir), run_dir, config,
                                       stem + ".wandb_id", args.resumed))
            except Exception as e:  # credentials, permissions, a server that does not answer
                warn(f"W&B could not start ({type(e).__name__}: {e}); not sending to Weights & Biases")
    if console:  # set-up's warnings are out: let go of the trainer's stderr (pipes through tee end with it)
        console.close()
        console = None
    if not sinks:
        return 0

    # A SIGTERM (a job's end) closes the outputs as the end of the run does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    count = 0
    try:
        flush = lambda: [sink.flush() for sink in sinks]
        for record in records(args.metrics, args.follow, args.pid, total_steps, args.idle_timeout, flush):
            values = scalars(record)
            for sink in sinks:
                sink.send(record["step"], values)
            count += 1
    finally:
        for sink in sinks:
            sink.close()
        print(f"follow_metrics: done, {count} records from {args.metrics}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
