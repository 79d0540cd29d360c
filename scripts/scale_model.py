#!/usr/bin/env python3
"""What a step costs in communication, and what that makes of step time and MFU, from one node to
many: FSDP over every GPU, or hybrid sharding (HSDP: shard within a node, replicate across).

  scale_model.py --config-json run.json                       # 1B/7B table for 1..64 nodes of 8 H100s
  scale_model.py --config-json run.json --bytes --world 4 --shard 2 [--ddp]   # one rank's bytes per step

run.json is `train_fsdp --config X --print-config` (shapes, batch, micro-batch, optimizer).

Bytes are exact: the same counts train_fsdp's metrics record (src/dist/comm.h's conventions:
sent + received per rank for the ring algorithm of each collective), from the same layouts
(RowShard's padded blocks, the units, Muon's owners), for rank 0; the test suite checks them
against real runs (tests/scale_model.sh). Time is a model with stated assumptions:

- a collective takes hops x latency + (its counted bytes / 2) / bandwidth (each rank sends and
  receives half of what is counted, at once);
- links (defaults: an 8x H100 SXM node, NVLink 4 within it, 8x 400 Gb/s InfiniBand per node, one
  NIC per GPU): a ring that stays in a node runs at the intra-node bandwidth, one that crosses
  nodes at the inter-node one per GPU;
- compute: FLOPs per token (train_fsdp's 6N + 12 L H Dh T) at --compute-efficiency of the
  peak (default 0.5 of 989 TFLOP/s: the MFU of one node is this assumption, not a prediction);
- weak scaling: every GPU trains as many sequences per step as on one node (the preset's batch
  over --gpus-per-node), so the global batch grows with the nodes;
- overlap as the engine schedules it: each block's all-gather hides behind the block before it
  (prefetch) and its reduce-scatter (and HSDP's all-reduce) behind the next block's backward, so
  a block exposes only what its collectives take beyond its compute; the root's first gather,
  the last reduction, Muon's exchange and the small all-reduces are exposed.
"""
import argparse
import json
import math
import sys


# --- the layouts (src/fsdp/row_shard.h, src/model/llama.cpp's parameter order) -------------------------
def block_numel(shape, W):
    rows = shape[0]
    row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
    return -(-rows // W) * row_numel  # ceil(rows / W) rows per rank, padded


def model_shapes(m):
    """(root shapes, one block's shapes, the Muon matrices in model order)."""
    D, F, V = m["dim"], m["ffn_hidden"], m["vocab_size"]
    Q, K = m["n_heads"] * m["head_dim"], m["n_kv_heads"] * m["head_dim"]
    block = [[Q, D], [K, D], [K, D], [D, Q], [F, D], [D, F], [F, D], [D], [D]]
    root = [[V, D], [D], [V, D]]
    muon = [s for _ in range(m["n_layers"]) for s in block if len(s) == 2]
    return root, block, muon


def muon_owners(matrices, W):
    # assign_muon_owners (src/optim/muon.cpp): by cost r*c*min(r, c), largest first, each to the
    # least-loaded rank (the first of equals).
    cost = [r * c * min(r, c) for r, c in matrices]
    order = sorted(range(len(matrices)), key=lambda i: -cost[i])  # stable, as std::stable_sort
    load, owner = [0.0] * W, [0] * len(matrices)
    for i in order:
        least = min(range(W), key=lambda r: (load[r], r))
        owner[i] = least
        load[least] += cost[i]
    return owner


class Counter:
    """One group's collectives for one rank: bytes per kind as Communicator::count counts them,
    and the calls themselves (kind, group size, the tensor's bytes: the all-gather's input, the
    reduce-scatter's output, the all-reduce's tensor, for all-to-all a block per rank; the
    counted bytes; and where the step has it: "gather" (a block's, forward), "regather" (again
    for its backward), "reduce" (a block's gradients), or "exposed" (nothing to hide behind))."""

    def __init__(self):
        self.bytes, self.calls = {}, []

    def add(self, kind, n, W, payload, role):
        self.bytes[kind] = self.bytes.get(kind, 0) + n
        self.calls.append((kind, W, payload, n, role))

    def all_gather(self, W, n, role="exposed"):
        self.add("all_gather", 2 * (W - 1) * n, W, n, role)

    def reduce_scatter(self, W, n, role="exposed"):
        self.add("reduce_scatter", 2 * (W - 1) * n, W, n, role)

    def all_reduce(self, W, n, role="exposed"):
        self.add("all_reduce", 4 * (W - 1) * n // W, W, n, role)


def hops(kind, W):
    """Ring steps of a collective over W ranks (an all-reduce is a reduce-scatter and a gather)."""
    return 2 * (W - 1) if kind == "all_reduce" else W - 1


def step_bytes(run, world, shard, ddp=False, rank=0, calls=None):
    """{group: {kind: bytes}} for one training step of rank `rank`: "shard_group",
    "replicate_group" (HSDP only) and "world" (collectives over every rank), and "total".
    `calls`, a dict, receives each group's list of collectives."""
    m = run["model"]
    root, block, muon = model_shapes(m)
    L = m["n_layers"]
    replicate = world // shard
    accum = run["batch_size"] // (world * run["micro_bs"])
    compute_bytes = 2 if run["resolved_compute_dtype"] == "bfloat16" else 4
    ns_bytes = 2 if run["resolved_ns_dtype"] == "bfloat16" else 4
    reduce_every = run.get("reduce_every_micro_batch") == "true" and accum > 1
    syncs = accum if reduce_every else 1
    groups = {"shard_group": Counter(), "replicate_group": Counter(), "world": Counter()}
    S, R, W = shard, replicate, world
    muon_on = run["hidden"]["type"] == "muon"

    if ddp:
        # Buckets of up to bucket_mb MiB of fp32 gradients in reverse model order, each all-reduced
        # on the synchronising micro-batches; Muon's results all-reduced in the Newton-Schulz dtype.
        shapes = root[:1] + [s for _ in range(L) for s in block] + root[1:]
        limit = max(1, int(run["bucket_mb"] * (1 << 20) / 4))
        buckets, current = [], 0
        for s in reversed(shapes):
            n = math.prod(s)
            if buckets and current + n <= limit:
                current += n
                buckets[-1] = current
            else:
                current = n
                buckets.append(current)
        for _ in range(syncs):
            for n in buckets:
                groups["world"].all_reduce(W, 4 * n)
        if muon_on and W > 1:
            groups["world"].all_reduce(W, ns_bytes * sum(r * c for r, c in muon))
    else:
        # The units: every block and the root, gathered in compute dtype, reduced in fp32.
        unit_block = [sum(block_numel(s, S) for s in block)] * L
        root_block = sum(block_numel(s, S) for s in root)
        g = groups["shard_group"] if R > 1 else groups["world"]
        regathered = L - 1 if run["reshard_after_forward"] else 0  # every block but the last, for backward
        for _ in range(accum):
            g.all_gather(S, compute_bytes * root_block)
            for b in unit_block:
                g.all_gather(S, compute_bytes * b, "gather")
            for b in unit_block[:regathered]:
                g.all_gather(S, compute_bytes * b, "regather")
        for _ in range(syncs):
            # Every block's reduction but the last one's (block 0, reduced last) hides behind the
            # backward of the block below it; the root's is exposed.
            for i, b in enumerate(unit_block + [root_block]):
                role = "reduce" if 0 < i < L else "exposed"
                g.reduce_scatter(S, 4 * b, role)
                if R > 1:
                    groups["replicate_group"].all_reduce(R, 4 * b, role)
        g.all_reduce(S, 4)  # the gradient norm's sum of squares, over the shard group
        if muon_on and S > 1:
            # Sharded Muon: every matrix's padded rows to its owner and back (two all-to-alls).
            owner = muon_owners(muon, S)
            blocks = [block_numel(s, S) for s in muon]
            mine = sum(b for b, o in zip(blocks, owner) if o == rank % S)
            others = sum(blocks) - mine
            for _ in range(2):  # there and back
                g.add("all_to_all", ns_bytes * (others + (S - 1) * mine), S, ns_bytes * max(blocks) * S, "exposed")
            if R > 1 and run.get("parallel", {}).get("muon_split_over_replicas", True):
                # The replicas share the owned matrices' results: one all-reduce of all of them.
                owned = sum(r * c for (r, c), o in zip(muon, owner) if o == rank % S)
                groups["replicate_group"].all_reduce(R, ns_bytes * owned)
        elif muon_on and R > 1 and run.get("parallel", {}).get("muon_split_over_replicas", True):
            # Shard groups of one: every rank holds whole matrices, as under DDP (replicated Muon).
            groups["replicate_group"].all_reduce(R, ns_bytes * sum(r * c for r, c in muon))
    # The trainer's own: loss and non-finite flag, and the stop/failed-save flags after the step's
    # record (2 floats each; the flags count in the next step's record, so from step 2 on).
    for _ in range(2):
        groups["world"].all_reduce(W, 8)

    if calls is not None:
        calls.update({name: c.calls for name, c in groups.items()})
    out = {name: c.bytes for name, c in groups.items()}
    total = {}
    for c in groups.values():
        for k, v in c.bytes.items():
            total[k] = total.get(k, 0) + v
    out["total"] = total
    return out


# --- the time model ---------------------------------------------------------------------------------
H100 = {"peak": 989e12, "intra_bw": 360e9, "intra_lat": 10e-6, "inter_bw": 45e9, "inter_lat": 20e-6}


def collective_seconds(counted_bytes, hops, bw, lat):
    return hops * lat + counted_bytes / 2 / bw


def predict(run, nodes, gpus, hsdp, link, efficiency):
    """Step time, exposed communication and MFU for `nodes` x `gpus` ranks, each GPU training the
    sequences it trains on one node (weak scaling: the global batch grows with the nodes). The
    collectives are step_bytes' list for rank 0, each timed on the link its group spans."""
    W = nodes * gpus
    S = gpus if hsdp else W
    L = run["model"]["n_layers"]
    per_gpu = run["batch_size"] // gpus  # sequences per GPU and step, as on one node
    run = dict(run, batch_size=per_gpu * W)
    accum = per_gpu // run["micro_bs"]
    tokens = per_gpu * run["seq_length"]  # per rank per step
    compute = run["flops_per_token"] * tokens / (link["peak"] * efficiency)
    # What a block's collective can hide behind, per micro-batch: the forward of the block before
    # it (a third of a block's compute) for its gather, the backward of the next one (two thirds)
    # for its gather again and for its reduction.
    forward = compute / L / accum / 3
    hide = {"gather": forward, "regather": 2 * forward, "reduce": 2 * forward, "exposed": 0.0}
    intra, inter = (link["intra_bw"], link["intra_lat"]), (link["inter_bw"], link["inter_lat"])
    spans = {"shard_group": S > gpus, "replicate_group": True, "world": W > gpus}  # crosses nodes?
    calls = {}
    step_bytes(run, W, S, calls=calls)
    seconds, slots, moved = {}, {}, {False: 0, True: 0}
    for group, cs in calls.items():
        bw, lat = inter if spans[group] else intra
        for kind, w, _, counted, role in cs:
            if w < 2:
                continue
            seconds[role] = seconds.get(role, 0.0) + collective_seconds(counted, hops(kind, w), bw, lat)
            # One slot per block and micro-batch (a replicated block's all-reduce shares its slot).
            slots[role] = slots.get(role, 0) + (kind != "all_reduce" or not hsdp)
            moved[spans[group]] += counted
    # The blocks are alike: what each exposes beyond its slot, summed, is the total beyond them all.
    exposed = sum(max(0.0, t - slots[role] * hide[role]) for role, t in seconds.items())
    step = compute + exposed
    return {"world": W, "exposed_comm_s": exposed, "step_s": step,
            "mfu_percent": 100 * run["flops_per_token"] * tokens / step / link["peak"],
            "bytes_intra": moved[False], "bytes_inter": moved[True]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True, nargs="+", help="train_fsdp --print-config output(s)")
    ap.add_argument("--bytes", action="store_true", help="print one rank's bytes per step as JSON")
    ap.add_argument("--world", type=int, help="with --bytes: ranks")
    ap.add_argument("--shard", type=int, help="with --bytes: ranks per shard group (default: all)")
    ap.add_argument("--ddp", action="store_true", help="with --bytes: train_ddp")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 8, 32, 64])
    ap.add_argument("--compute-efficiency", type=float, default=0.5, help="fraction of peak the math runs at")
    ap.add_argument("--intra-gbps", type=float, default=H100["intra_bw"] / 1e9, help="GB/s per GPU within a node")
    ap.add_argument("--inter-gbps", type=float, default=H100["inter_bw"] / 1e9, help="GB/s per GPU across nodes")
    args = ap.parse_args()
    runs = [json.load(open(p)) for p in args.config_json]
    if args.bytes:
        out = step_bytes(runs[0], args.world, args.shard or args.world, args.ddp)
        print(json.dumps(out, indent=1))
        return 0
    link = dict(H100, intra_bw=args.intra_gbps * 1e9, inter_bw=args.inter_gbps * 1e9)
    print(f"assumptions: {link['peak'] / 1e12:.0f} TFLOP/s peak at {args.compute_efficiency:.0%}, "
          f"{args.intra_gbps:.0f} GB/s in a node, {args.inter_gbps:.0f} GB/s per GPU across nodes, "
          f"{link['intra_lat'] * 1e6:.0f}/{link['inter_lat'] * 1e6:.0f} us latency, {args.gpus_per_node} GPUs a node")
    print("| model | layout | nodes | GPUs | batch/GPU/step | step s | exposed comm s | MFU | GB/step/GPU in node | GB/step/GPU across |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        for hsdp in (False, True):
            for n in args.nodes:
                if hsdp and n == 1:
                    continue
                p = predict(run, n, args.gpus_per_node, hsdp, link, args.compute_efficiency)
                print(f"| {run['name_model']} | {'HSDP' if hsdp else 'FSDP'} | {n} | {p['world']} | "
                      f"{run['batch_size'] * run['seq_length'] // args.gpus_per_node:,} tokens | {p['step_s']:.3f} | "
                      f"{p['exposed_comm_s']:.3f} | {p['mfu_percent']:.1f}% | {p['bytes_intra'] / 1e9:.2f} | "
                      f"{p['bytes_inter'] / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
