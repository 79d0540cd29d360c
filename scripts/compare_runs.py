#!/usr/bin/env python3
"""Compare two training runs' metrics (JSON lines): a CSV of the losses side by side, a PNG of
the two loss curves, and the largest and final differences.

    compare_runs.py A.jsonl B.jsonl OUT_DIR [--labels FSDP DDP]
"""
import argparse
import csv
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    rows = [json.loads(line) for line in open(path)]
    return {r["step"]: r for r in rows}


ap = argparse.ArgumentParser()
ap.add_argument("a")
ap.add_argument("b")
ap.add_argument("out")
ap.add_argument("--labels", nargs=2, default=["FSDP", "DDP"])
args = ap.parse_args()
a, b = load(args.a), load(args.b)
steps = sorted(set(a) & set(b))
if not steps:
    raise SystemExit("compare_runs: the runs share no step")
os.makedirs(args.out, exist_ok=True)
la, lb = args.labels
with open(os.path.join(args.out, "losses.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["step", f"loss_{la}", f"loss_{lb}", "difference", f"val_loss_{la}", f"val_loss_{lb}"])
    for s in steps:
        w.writerow([s, a[s]["loss"], b[s]["loss"], a[s]["loss"] - b[s]["loss"],
                    a[s].get("val_loss", ""), b[s].get("val_loss", "")])
diffs = [abs(a[s]["loss"] - b[s]["loss"]) for s in steps]
worst = max(range(len(steps)), key=lambda i: diffs[i])
plt.figure(figsize=(8, 4.5))
plt.plot(steps, [a[s]["loss"] for s in steps], label=la, linewidth=1.5)
plt.plot(steps, [b[s]["loss"] for s in steps], label=lb, linewidth=1.0, linestyle="--")
vs = [s for s in steps if "val_loss" in a[s] and "val_loss" in b[s]]
if vs:
    plt.plot(vs, [a[s]["val_loss"] for s in vs], "o", label=f"{la} validation")
    plt.plot(vs, [b[s]["val_loss"] for s in vs], "x", label=f"{lb} validation")
plt.xlabel("step")
plt.ylabel("loss")
plt.title(f"{la} vs {lb}: largest |difference| {diffs[worst]:.2e} (step {steps[worst]})")
plt.legend()
plt.grid(alpha=0.3)
plt.tight_layout()
plt.savefig(os.path.join(args.out, "losses.png"), dpi=120)
print(f"{len(steps)} steps; final loss {la} {a[steps[-1]]['loss']:.6f}, {lb} {b[steps[-1]]['loss']:.6f}; "
      f"final difference {diffs[-1]:.3e}; largest difference {diffs[worst]:.3e} at step {steps[worst]}")
print(f"wrote {args.out}/losses.csv and {args.out}/losses.png")
