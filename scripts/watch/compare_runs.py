#!/usr/bin/env python3
"""Compare two training runs' metrics (JSON lines): a CSV of the losses side by side and the
largest and final differences (scripts/watch/plot_runs.py draws them).

    compare_runs.py A.jsonl B.jsonl OUT_DIR [--labels FSDP DDP]
"""
import argparse
import csv
import json
import os



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
print(f"{len(steps)} steps; final loss {la} {a[steps[-1]]['loss']:.6f}, {lb} {b[steps[-1]]['loss']:.6f}; "
      f"final difference {diffs[-1]:.3e}; largest difference {diffs[worst]:.3e} at step {steps[worst]}")
print(f"wrote {args.out}/losses.csv")
