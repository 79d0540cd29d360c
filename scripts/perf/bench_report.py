#!/usr/bin/env python3
"""Summarises scripts/perf/bench.sh's runs: one row per implementation (train_fsdp and its PyTorch
peers) from their JSON-lines metrics, the ratio ours / PyTorch, as a Markdown table on stdout and
as JSON.

  bench_report.py --config-json run.json --world-size 2 --warmup 5 --out bench.json \
      zeroband-cpp=ours.jsonl pytorch-zeroband-eager=peer.jsonl [pytorch-torch-eager=... ...]

Steps before --warmup are left out (allocator growth, first-touch, compilation). Throughput is
tokens over wall time between the first and last kept steps, per rank; the step split is the
mean of the kept steps; MFU is train_fsdp's formula, FLOPs/token x tokens/s per rank / the
device's peak (n/a on CPU unless runtime.peak_flops is set). Bytes are per rank and step, in all
and by group of ranks as train_fsdp's metrics name them (comm_bytes_shard_group, _tp_group,
_replicate_group); a run without such groups shards over the whole world, so its shard group is
the world. The groups' bytes add up to a little less than the total: collectives over the whole
world (the loss's all-reduce, a norm over both mesh dimensions) belong to neither.
"""
import argparse
import json
import statistics


def peak_flops_of(name):
    # train_fsdp's table (src/observe/metrics.cpp): dense bf16 tensor-core peaks.
    if "A100" in name:
        return 312e12
    if "H100" in name:
        return 835e12 if "NVL" in name else 756e12 if "PCIe" in name else 989e12
    if "H200" in name:
        return 989e12
    return None


def summarise(path, run, world, warmup, peak, profile_summary=None):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if rows and "unsupported" in rows[0]:  # a peer that cannot train this run says why
        return {"unsupported": rows[0]["unsupported"]}
    # The last step was recorded by a profiler (operator counts): left out of the timings.
    counts = profile_summary or next((r for r in rows if "ops_dispatched" in r), None)
    timed = rows[:-1] if counts and len(rows) > warmup + 2 else rows
    kept = timed[warmup:] if len(timed) > warmup + 1 else timed
    first, last = kept[0], kept[-1]
    # Wall time from the end of the first kept step to the end of the last one.
    steps = len(kept) - 1
    seconds = last["time"] - first["time"]
    tokens = last["total_tokens"] - first["total_tokens"]
    per_rank = tokens / seconds / world if seconds > 0 else float("nan")
    mean = lambda key: statistics.fmean(r[key] for r in kept[1:] or kept)
    comm = {k: statistics.fmean(r["comm_bytes"][k] for r in kept) for k in last["comm_bytes"]}
    # Hybrid sharding: the part within the shard groups (a node) and across them, per step.
    groups = {k[len("comm_bytes_"):]: statistics.fmean(sum(r[k].values()) for r in kept)
              for k in last if k.startswith("comm_bytes_")}
    return {
        "steps_measured": steps,
        "tokens_per_second_per_rank": per_rank,
        "mfu_percent": 100 * run["flops_per_token"] * per_rank / peak if peak else None,
        "step_seconds": seconds / steps if steps else float("nan"),
        "forward_seconds": mean("forward_seconds"),
        "backward_seconds": mean("backward_seconds"),
        "optimizer_seconds": mean("optimizer_seconds"),
        "exposed_comm_seconds": mean("comm_wait_seconds"),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows),
        "comm_bytes_per_step": comm,
        "comm_bytes_per_step_by_group": groups,
        "first_loss": rows[0]["loss"],  # before any update: the same weights and rows on every side
        "final_loss": rows[-1]["loss"],
        "ops_dispatched_per_step": counts and counts.get("ops_dispatched", counts.get("ops_per_step")),
        "kernels_launched_per_step": counts and counts.get("kernels_launched", counts.get("kernels_per_step")),
        "attention_kernel": last.get("attention_kernel"),
    }


def layout_of(run, world):
    """The ranks' layout as train_fsdp reads parallel.*: TP groups of consecutive ranks inside shard
    groups, replicated across them."""
    par = run.get("parallel", {})
    tp, replicate = par.get("tp", 1), par.get("dp_replicate", 1)
    shard = par["dp_shard"] if par.get("dp_shard", -1) > 0 else world // (tp * replicate)
    parts = ([f"TP {tp}"] if tp > 1 else []) + [f"FSDP {shard}"] + ([f"{replicate} replicas"] if replicate > 1 else [])
    return " x ".join(parts)


def group_bytes(r, group):
    """Mean bytes per step in `group` ("shard", "tp", "replicate"), or None if the run has no such
    group (a run without groups: its one shard group is the world)."""
    by_group = r["comm_bytes_per_step_by_group"]
    if not by_group:
        return sum(r["comm_bytes_per_step"].values()) if group == "shard" else None
    return by_group.get(group + "_group")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="", help="device name, for the MFU peak and the record")
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", default="{}", help="JSON merged into the output (date, commit, command)")
    ap.add_argument("--profile-summary", default="",
                    help="ours' profile summary of its last step (train_fsdp's rank0_summary.json)")
    ap.add_argument("runs", nargs="+", help="NAME=metrics.jsonl, ours first")
    args = ap.parse_args()
    run = json.load(open(args.config_json))
    peak = run["runtime"]["peak_flops"] or peak_flops_of(args.device)
    results = {}
    for i, spec in enumerate(args.runs):
        name, path = spec.split("=", 1)
        summary = json.load(open(args.profile_summary)) if i == 0 and args.profile_summary else None
        results[name] = summarise(path, run, args.world_size, args.warmup, peak, summary)

    names = list(results)
    ours = results[names[0]]
    ran = {name: r for name, r in results.items() if "unsupported" not in r}
    ratios = {}
    for peer in list(ran)[1:]:
        p = results[peer]
        ratios[f"{names[0]} / {peer}"] = {
            "tokens_per_second": ours["tokens_per_second_per_rank"] / p["tokens_per_second_per_rank"],
            "peak_memory": ours["peak_memory_bytes"] / p["peak_memory_bytes"],
            "comm_bytes": (sum(ours["comm_bytes_per_step"].values()) / sum(p["comm_bytes_per_step"].values())
                           if sum(p["comm_bytes_per_step"].values()) else None),
            "ops_dispatched": (ours["ops_dispatched_per_step"] / p["ops_dispatched_per_step"]
                               if ours["ops_dispatched_per_step"] and p["ops_dispatched_per_step"] else None),
        }

    fmt = lambda v, f: "n/a" if v is None else f.format(v)
    layout = layout_of(run, args.world_size)
    print(f"{run['name_model']} ({run['num_params']:,} parameters), {args.world_size} rank(s) as {layout}, "
          f"batch {run['batch_size']} x {run['seq_length']}, micro_bs {run['micro_bs']}, device {args.device or '?'}, "
          f"attention {run['attention']}, compute {run['resolved_compute_dtype']}, "
          f"hidden matrices {run['hidden']['type']}, "
          f"Newton-Schulz {run['resolved_ns_dtype'] if run['hidden']['type'] == 'muon' else 'n/a'} on every side")
    kernels = {name: r["attention_kernel"] for name, r in ran.items() if r.get("attention_kernel")}
    if kernels:
        print("peers' attention kernels: " + ", ".join(f"{name} {k}" for name, k in kernels.items()))
    print()
    # Bytes by group: shard and TP always, the replicas' when a run has them.
    group_names = ["shard", "tp"] + (["replicate"] if any(group_bytes(r, "replicate") is not None
                                                         for r in ran.values()) else [])
    print("| run | tokens/s/rank | MFU | step s | forward s | backward s | optimizer s | exposed comm s "
          "| peak mem GiB/rank | comm MB/step/rank | " + " | ".join(f"{g} MB" for g in group_names)
          + " | first loss | final loss |")
    print("|---|" + "---|" * (11 + len(group_names)))
    for name, r in results.items():
        if "unsupported" in r:
            print(f"| {name} | not run: {r['unsupported']} " + "| " * (10 + len(group_names)) + "|")
            continue
        mb = sum(r["comm_bytes_per_step"].values()) / 1e6
        groups = " | ".join("-" if group_bytes(r, g) is None else f"{group_bytes(r, g) / 1e6:.1f}" for g in group_names)
        print(f"| {name} | {r['tokens_per_second_per_rank']:,.0f} | {fmt(r['mfu_percent'], '{:.1f}%')} "
              f"| {r['step_seconds']:.3f} | {r['forward_seconds']:.3f} | {r['backward_seconds']:.3f} "
              f"| {r['optimizer_seconds']:.3f} | {r['exposed_comm_seconds']:.3f} "
              f"| {r['peak_memory_bytes'] / 2**30:.2f} | {mb:.1f} | {groups} | {r['first_loss']:.6f} "
              f"| {r['final_loss']:.4f} |")
    print()
    for label, q in ratios.items():
        print(f"{label}: tokens/s x{q['tokens_per_second']:.2f}, peak memory x{q['peak_memory']:.2f}, "
              f"bytes communicated {fmt(q['comm_bytes'], 'x{:.2f}')}, "
              f"operators dispatched {fmt(q['ops_dispatched'], 'x{:.2f}')}")
    counted = {name: r for name, r in ran.items() if r.get("ops_dispatched_per_step")}
    if counted:
        print("operators dispatched per step (the last step, profiled; the CPU-side cost of launching work): " +
              ", ".join(f"{name} {r['ops_dispatched_per_step']:,}" +
                        (f" ({r['kernels_launched_per_step']:,} GPU kernels)" if r.get("kernels_launched_per_step") else "")
                        for name, r in counted.items()))
    for name, r in ran.items():
        kinds = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in r["comm_bytes_per_step"].items() if v)
        print(f"{name} comm MB/step by kind: {kinds}")
        if r.get("comm_bytes_per_step_by_group"):
            groups = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in r["comm_bytes_per_step_by_group"].items())
            print(f"{name} comm MB/step by group of ranks: {groups}")

    record = {"config": run["name_model"], "world_size": args.world_size, "layout": layout, "device": args.device,
              "warmup_steps_skipped": args.warmup, "peak_flops": peak, "results": results, "ratios": ratios}
    record.update(json.loads(args.meta))
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
