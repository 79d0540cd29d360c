#!/usr/bin/env python3
"""Checks scripts/perf/scale_model.py's time model where it can be run: on this machine's Gloo.

Under torchrun (W ranks): fits the model's two link figures (latency per ring hop, bandwidth)
to single collectives of 1 KiB to 16 MiB, then replays one training step's collectives
(the step plan's for the run and layout, as scale_model times them: the same kinds, groups and
sizes, in order, without the compute between them) and compares the time they take with the
time the fitted model predicts for them.

  build/apps/train_fsdp --config C.toml --world-size 4 [--parallel.dp_shard 2 --parallel.dp_replicate 2] \\
      --print-plan > plan.json        # train_ddp for DDP
  torchrun --nproc_per_node 4 scripts/perf/comm_replay.py --plan plan.json [--out replay.json]

Prints on rank 0; --out gets the fit, the measured and predicted seconds and the error.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_bytes  # noqa: E402
from scale_model import collective_seconds, hops, plan_calls  # noqa: E402


def timed(fn, reps):
    dist.barrier()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_call(kind, W, payload, counted, group):
    """One collective as the engine makes it, with tensors of its size."""
    if kind == "all_gather":
        x = torch.empty(max(1, payload), dtype=torch.uint8)
        out = torch.empty(W * x.numel(), dtype=torch.uint8)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if kind == "reduce_scatter":
        out = torch.zeros(max(1, payload // 4))
        x = torch.zeros(W * out.numel())
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if kind == "all_reduce":
        x = torch.zeros(max(1, payload // 4))
        return lambda: dist.all_reduce(x, group=group)
    # all-to-all: the counted bytes, sent and received in equal parts to and from each other rank
    per_peer = max(1, counted // (2 * (W - 1)))
    x = torch.empty(W * per_peer, dtype=torch.uint8)
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x, group=group)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True, help="rank 0's step plan (--print-plan) for this world")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    plan = json.load(open(args.plan))
    assert plan["world"] == W, f"the plan is for {plan['world']} ranks, this world has {W}"
    ddp = plan["parallelism"] == "ddp"
    S = W if ddp else plan["shard"]  # DDP's collectives are all over the world

    # 1. The fit, over the whole world, per kind of collective (Gloo's algorithms differ: its
    #    all-reduce is far from a ring's cost): time = hops x latency + counted / 2 / bandwidth.
    rows = []
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        for size in [1 << k for k in range(10, 25, 2)]:
            counted = comm_bytes.counted(kind, W, size)
            seconds = timed(run_call(kind, W, size, counted, None), args.reps)
            rows.append((kind, counted, seconds))
            if rank == 0 and os.environ.get("ZB_REPLAY_VERBOSE"):
                print(kind, size, f"{seconds * 1e3:.3f} ms")
    fit = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        mine = [(hops(kind, W), counted / 2, t) for k, counted, t in rows if k == kind]
        # Least squares on relative errors (small and large collectives count alike); latency >= 0.
        A = torch.tensor([[h / t, b / t] for h, b, t in mine], dtype=torch.float64)
        y = torch.ones(len(mine), dtype=torch.float64)
        latency, inverse_bw = torch.linalg.lstsq(A, y).solution.tolist()
        if latency < 0:
            latency, inverse_bw = 0.0, torch.linalg.lstsq(A[:, 1:], y).solution.item()
        fit[kind] = (latency, 1 / inverse_bw)
    fit["all_to_all"] = fit["all_gather"]  # point to point as the all-gather's ring
    model = lambda kind, w, counted: collective_seconds(counted, hops(kind, w), fit[kind][1], fit[kind][0])
    fit_error = max(abs(model(k, W, counted) - t) / t for k, counted, t in rows)

    # 2. The step's collectives, replayed in their groups.
    # Rank 0's list on every rank: the ranks' Muon exchanges differ a little in size (which
    # matrices each owns), and a replay needs the same sizes everywhere.
    calls = plan_calls(plan)
    groups = {"world": None}
    if S < W:
        for g in range(W // S):  # every rank creates every group, in the same order
            ranks = list(range(g * S, (g + 1) * S))
            pg = dist.new_group(ranks)
            if rank in ranks:
                groups["shard"] = pg
        for r in range(S):
            ranks = list(range(r, W, S))
            pg = dist.new_group(ranks)
            if rank in ranks:
                groups["replicate"] = pg
    step = [(kind, w, payload, counted, groups[g]) for g, cs in calls.items() for kind, w, payload, counted, _ in cs
            if w > 1]
    fns = [run_call(*c) for c in step]
    measured = timed(lambda: [f() for f in fns], args.reps)
    predicted = sum(model(kind, w, counted) for kind, w, _, counted, _ in step)
    result = {"world": W, "shard": S, "ddp": ddp,
              "fit": {k: {"latency_per_hop_s": a, "bandwidth_bytes_per_s": b} for k, (a, b) in fit.items()},
              "fit_largest_relative_error": fit_error, "collectives_per_step": len(step),
              "measured_seconds": measured, "predicted_seconds": predicted,
              "relative_error": (predicted - measured) / measured}
    if rank == 0:
        figures = ", ".join(f"{k} {a * 1e6:.0f} us/hop {b / 1e9:.2f} GB/s" for k, (a, b) in fit.items() if k != "all_to_all")
        print(f"Gloo fit on {W} ranks: {figures} (largest error over {len(rows)} collectives {fit_error:.0%})")
        print(f"one step's {len(step)} collectives ({'DDP' if ddp else f'shard {S} x replicate {W // S}'}): "
              f"measured {measured:.4f} s, predicted {predicted:.4f} s, error {result['relative_error']:+.0%}")
        if args.out:
            json.dump(result, open(args.out, "w"), indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
