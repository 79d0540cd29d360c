#!/usr/bin/env python3
"""The table and plot of scripts/perf/diloco_bench.sh: for each run, the final training loss (mean of
the last 20 steps), the validation losses, and what crossed between replicas per step (bytes as
src/dist/comm_bytes.h counts them: the replicate group's under DiLoCo, every gradient collective
under train_ddp); one plot of the loss curves.

    diloco_report.py OUT_DIR NAME [NAME ...]      (OUT_DIR/NAME.jsonl from the bench)
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    by_step = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def across_replicas_per_step(records):
    """Bytes between replicas per step: the replicate group's (DiLoCo), else the world's (DDP, or
    one process: none)."""
    key = "comm_bytes_replicate_group" if "comm_bytes_replicate_group" in records[0] else "comm_bytes"
    return sum(sum(r[key].values()) for r in records) / len(records)


def smooth(values, alpha=0.1):
    out, ema = [], None
    for v in values:
        ema = v if ema is None else (1 - alpha) * ema + alpha * v
        out.append(ema)
    return out


def main():
    out_dir, names = sys.argv[1], sys.argv[2:]
    runs = {n: load(os.path.join(out_dir, f"{n}.jsonl")) for n in names}
    print(f"| run | final train loss (last 20 steps) | validation loss (steps) | bytes across replicas per step |")
    print("|---|---|---|---|")
    for name, records in runs.items():
        train = [r["loss"] for r in records[-20:]]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        print(f"| {name} | {sum(train) / len(train):.4f} | "
              f"{', '.join(f'{v:.4f} ({s})' for s, v in val[-3:])} | "
              f"{across_replicas_per_step(records):,.0f} |")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        line, = ax.plot(steps, smooth([r["loss"] for r in records]), label=name, linewidth=1.2)
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o", color=line.get_color(), markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (train: moving average; dots: validation)")
    ax.set_title("DiLoCo on the CPU: debug model, the same global batch, 4 processes")
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(out_dir, "losses.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print("plot:", path)


if __name__ == "__main__":
    main()
