#!/usr/bin/env python3
"""Plots training runs side by side from their metrics (the JSON lines train_fsdp and train_ddp
write): loss with validation loss, learning rates, grad norm, tokens/s, MFU, peak memory and each
block's largest attention logit (logging.max_attention_logit), one panel each, the runs overlaid
under their names.

  plot_runs.py outputs/run-a outputs/run-b/metrics.jsonl -o runs.png [--names A B] [--log-loss]

A RUN is a metrics file or the directory holding metrics.jsonl. Named after its directory unless
--names says. Where a resumed run repeated steps, the last record of a step is the one plotted.
Panels no run has data for (MFU on CPU) are left out.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                by_step[r["step"]] = r  # a repeated step: the later record counts
    return [by_step[s] for s in sorted(by_step)]


def series(records, key):
    """(steps, values) of a key, a "lr/<group>" path, skipping records without it."""
    steps, values = [], []
    for r in records:
        v = r
        for part in key.split("/"):
            v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            steps.append(r["step"])
            values.append(v)
    return steps, values


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN")
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    ap.add_argument("--names", nargs="+", help="one name per run")
    ap.add_argument("--log-loss", action="store_true", help="loss on a log scale")
    args = ap.parse_args()
    if args.names and len(args.names) != len(args.runs):
        ap.error("--names needs one name per run")
    names = args.names or [os.path.basename(os.path.dirname(os.path.abspath(
        os.path.join(r, "metrics.jsonl") if os.path.isdir(r) else r))) for r in args.runs]
    runs = [(name, load(path)) for name, path in zip(names, args.runs)]

    lr_keys = sorted({f"lr/{g}" for _, rs in runs for r in rs for g in r.get("lr", {})})
    logit_keys = sorted({f"max_attention_logit/{b}" for _, rs in runs for r in rs
                         for b in r.get("max_attention_logit", {})}, key=lambda k: int(k.rsplit(".", 1)[-1]))
    panels = [("loss", ["loss", "val_loss"], args.log_loss), ("learning rate", lr_keys, False),
              ("grad norm", ["grad_norm"], False), ("tokens/s", ["tokens_per_second"], False),
              ("MFU %", ["mfu"], False), ("peak memory GiB", ["peak_memory_bytes"], False),
              ("largest attention logit", logit_keys, False)]
    panels = [p for p in panels if any(series(rs, k)[0] for _, rs in runs for k in p[1])]
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.6 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys, log) in zip(axes.flat, panels):
        for i, (name, rs) in enumerate(runs):
            for j, key in enumerate(keys):
                x, y = series(rs, key)
                if not x:
                    continue
                if key == "peak_memory_bytes":
                    y = [v / 2**30 for v in y]
                label = name if len(keys) == 1 else f"{name} {key.split('/')[-1]}"
                style = dict(marker="o", markersize=3, linestyle="--") if key == "val_loss" else \
                    dict(linestyle=["-", ":", "-.", (0, (5, 1))][j % 4])
                ax.plot(x, y, color=colours[i % len(colours)], label=label, linewidth=1.2, **style)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_runs: {len(runs)} run(s), {len(panels)} panels -> {args.out}")


if __name__ == "__main__":
    main()
