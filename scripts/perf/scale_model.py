#!/usr/bin/env python3
"""What a step costs in communication, and what that makes of step time and MFU, from one node to
many: FSDP over every GPU, hybrid sharding (HSDP: shard within a node, replicate across), or
DiLoCo over the nodes (--diloco H: each node a replica training alone, an outer exchange every H
steps).

  scale_model.py --train build/apps/train_fsdp --config A.toml [B.toml] [-- OVERRIDES]
                                       # the table for 1..64 nodes of 8 H100s
  scale_model.py --train build/apps/train_fsdp --config A.toml --bytes --world 4 [--shard 2] [--ddp] [-- OVERRIDES]
                                       # one rank's bytes per step, by group and kind
  scale_model.py ... --config A.toml --diloco 10 100 --inter-gbps 0.0156 --inter-latency-ms 100
                                       # nodes joined by 1 Gbit/s links (shared by 8 GPUs), 100 ms away
  scale_model.py ... --config A.toml --diloco 100 --failures --inter-gbps 0.0156
                                       # elastic replicas: the time one lost (and rejoining) node costs
  scale_model.py ... --config A.toml --tp 1 2 4 8   # rows with tensor parallelism inside each node
  scale_model.py ... --config A.toml --cp 1 2 4 -- --data.seq_length 32768 --train.micro_bs 1
                                       # rows with context parallelism inside each node
  scale_model.py ... --config configs/moe/moonlight_16B_8xH100.toml --ep 8 64
                                       # a mixture of experts, expert parallelism over 8 or 64 GPUs

OVERRIDES are the program's own: for a GPU run planned here, --runtime.device cuda and the GPU's
memory (--runtime.device_memory_gb 80), so that dtypes and the memory verdict (the peak per GPU,
whether the run fits, and so whether gradients are reduced on every micro-batch) are the GPU's. Nothing about a step is
derived here: the program's step plan (`--print-plan`, src/plan/step_plan.h) lists every
collective of a step with its group, bytes as src/dist/comm_bytes.h counts them and what it can hide
behind, and `--print-config` gives the FLOPs per token and the batch. The plan is the engine's
own description of its step, tested equal to what the engine does (tests/test_step_plan.cpp),
and the bytes equal to the metrics of real runs (tests/e2e/test_scale_model.py). Time is a model with
stated assumptions:

- a collective takes hops x latency + (its counted bytes / 2) / bandwidth (each rank sends and
  receives half of what is counted, at once);
- links (defaults: an 8x H100 SXM node, NVLink 4 within it, 8x 400 Gb/s InfiniBand per node, one
  NIC per GPU): a ring that stays in a node runs at the intra-node bandwidth, one that crosses
  nodes at the inter-node one per GPU;
- compute: FLOPs per token (train_fsdp's 6N + 12 L H Dh T) at --compute-efficiency of the
  peak (default 0.5 of 989 TFLOP/s: the MFU of one node is this assumption, not a prediction),
  plus, under activation checkpointing, each recomputed block's forward again (time that MFU,
  counting the model's FLOPs only, does not credit: every block recomputed costs a quarter of MFU);
- weak scaling: every GPU trains as many sequences per step as on one node (the preset's batch
  over --gpus-per-node), so the global batch grows with the nodes;
- overlap as the plan marks it: each block's all-gather hides behind the block before it
  (prefetch), its gather for backward and its reduce-scatter (and HSDP's all-reduce) behind a
  block's backward, so a block exposes only what its collectives take beyond its compute; the
  root's first gather, the last reduction, Muon's exchange and the small all-reduces are exposed;
- DiLoCo: the plan's outer exchanges (each fragment's, over the replicate group, across nodes) once
  per H steps; blocking without a fragment delay, else hidden behind that many steps of compute;
- expert parallelism (--ep): the plan's all-to-alls, their bytes a balanced routing's, exposed; an
  EP group spans its shard group, the experts' shard groups (S/ep consecutive ranks) less.
"""
import argparse
import json
import os
import subprocess
import sys


# --- the program's own description of the run and of its step --------------------------------------
def program_json(train, config, overrides, *extra):
    out = subprocess.run([train, "--config", config, *overrides, *extra], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def run_of(train, config, overrides, world):
    """The resolved run (--print-config) on `world` ranks: name, FLOPs per token, batch, micro-batch."""
    return program_json(train, config, overrides, "--print-config", "--world-size", str(world))


def step_plan(train, config, overrides, world, shard, ddp=False, rank=0, batch_size=None, inner_steps=0, tp=1, cp=1,
              ep=1):
    """Rank `rank`'s plan of one step (--print-plan) on `world` ranks, `shard` per shard group (its
    context-parallel ranks included), `tp` per tensor-parallel group, `cp` per context-parallel
    group and `ep` per expert-parallel group (train_ddp's for --ddp: the program beside train_fsdp)."""
    program = os.path.join(os.path.dirname(train), "train_ddp") if ddp else train
    extra = ["--world-size", str(world), f"--print-plan={rank}"]
    if not ddp:
        extra += ["--parallel.dp_shard", str(shard // cp), "--parallel.dp_replicate", str(world // (shard * tp)),
                  "--parallel.tp", str(tp)] + (["--parallel.cp", str(cp)] if cp > 1 else [])
        extra += ["--parallel.ep", str(ep)] if ep > 1 else []
    if batch_size:
        extra += ["--optim.batch_size", str(batch_size)]
    if inner_steps:
        extra += ["--diloco.inner_steps", str(inner_steps)]
    return program_json(program, config, overrides, *extra)


def plan_calls(plan):
    """The step's collectives by group: (kind, ranks, payload, counted bytes, overlap)."""
    calls = {}
    for e in plan["events"]:
        if e["op"] == "collective":
            calls.setdefault(e["group"], []).append((e["kind"], e["ranks"], e["payload"], e["counted"], e["overlap"]))
    return calls


# --- the time model ---------------------------------------------------------------------------------
H100 = {"peak": 989e12, "intra_bw": 360e9, "intra_lat": 10e-6, "inter_bw": 45e9, "inter_lat": 20e-6}


def hops(kind, W):
    """Ring steps of a collective over W ranks (an all-reduce is a reduce-scatter and a gather)."""
    return 2 * (W - 1) if kind == "all_reduce" else W - 1


def collective_seconds(counted_bytes, hops, bw, lat):
    return hops * lat + counted_bytes / 2 / bw


def predict(train, config, overrides, run, nodes, gpus, hsdp, link, efficiency, inner_steps=0, tp=1, cp=1, ep=1):
    """Step time, exposed communication and MFU for `nodes` x `gpus` ranks, each GPU training the
    sequences it trains on one node (weak scaling: the global batch grows with the nodes). The
    collectives are the step plan's for rank 0, each timed on the link its group spans. With
    `inner_steps`: DiLoCo over the nodes (shard groups of a node), its outer exchanges amortised.
    With `tp`: tensor parallelism inside a node; a TP group trains tp times a GPU's sequences
    (its GPUs each do 1/tp of the math), and its collectives are exposed (no overlap modelled).
    With `cp`: context parallelism inside a node, the same way (a CP group trains cp times a GPU's
    sequences, each GPU 1/cp of every row). With `ep`: expert parallelism over ep ranks of each shard
    group."""
    W = nodes * gpus
    S = (gpus if hsdp or inner_steps else W) // tp
    L = run["model"]["n_layers"]
    per_gpu = run["batch_size"] // gpus  # sequences per GPU and step, as on one node
    accum = per_gpu * tp * cp // run["micro_bs"]  # micro-batches of a TP and CP group
    tokens = per_gpu * run["seq_length"]  # per rank per step
    plan = step_plan(train, config, overrides, W, S, batch_size=per_gpu * W, inner_steps=inner_steps, tp=tp, cp=cp,
                     ep=ep)
    # Activation checkpointing runs a recomputed block's forward again in its backward: a third of
    # the block's FLOPs more, which takes time but is not in MFU's count (the model's FLOPs only).
    m = run["model"]
    head = 6 * (m["vocab_size"] * m["dim"] + m["dim"])  # output head and final norm: never recomputed
    recomputed = sum(e["op"] == "recompute" for e in plan["events"]) / plan["micro_batches"] / L
    flops = run["flops_per_token"] + recomputed * (run["flops_per_token"] - head) / 3
    compute = flops * tokens / (link["peak"] * efficiency)
    # What a block's collective can hide behind, per micro-batch: the forward of the block before
    # it (a third of a block's FLOPs) for its gather, the backward of the next one (two thirds,
    # and its recompute) for its gather again and for its reduction.
    forward = (run["flops_per_token"] - head) * tokens / (link["peak"] * efficiency) / L / accum / 3
    backward = (2 + recomputed) * forward
    hide = {"gather": forward, "regather": backward, "reduce": backward, "exposed": 0.0}
    intra, inter = (link["intra_bw"], link["intra_lat"]), (link["inter_bw"], link["inter_lat"])
    spans = {"shard": S * tp > gpus, "replicate": True, "world": W > gpus, "tp": False, "cp": False,  # crosses nodes?
             "ep": S * tp > gpus, "expert_shard": S * tp // ep > gpus}
    calls = plan_calls(plan)
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
    d = plan.get("diloco")
    outer = 0.0
    if d and nodes > 1:
        # Each fragment's exchange once per period: blocking, or hidden behind fragment_delay steps.
        bw, lat = inter
        for events in d["exchanges"]:
            t = sum(collective_seconds(e["counted"], hops(e["kind"], e["ranks"]), bw, lat) for e in events)
            hidden = d["fragment_delay"] * (compute + exposed)
            outer += max(0.0, t - hidden) / d["inner_steps"]
        exposed += outer
        moved[True] += d["replicate_bytes_per_period"] / d["inner_steps"]
    step = compute + exposed
    return {"world": W, "exposed_comm_s": exposed, "step_s": step, "outer_s": outer,
            "reduce_every_micro_batch": plan["reduce_every_micro_batch"], "memory": plan.get("memory"),
            "mfu_percent": 100 * run["flops_per_token"] * tokens / step / link["peak"],
            "bytes_intra": moved[False], "bytes_inter": moved[True]}


def peak_text(memory):
    """The memory estimate's peak per GPU (rank 0's), and whether the program would start the run."""
    if not memory:
        return "-"
    peak = f"{memory['peak_bytes'] / 2**30:.1f} GiB"
    if not memory["usable_bytes"]:
        return f"{peak} (no budget: --runtime.device_memory_gb)"
    return peak if memory["fits"] else f"{peak}: does not fit"


def refused(p):
    """Whether the program would refuse to start the run (its memory estimate does not fit)."""
    return bool(p["memory"]) and not p["memory"]["fits"]


def timing_text(p):
    """Step seconds, exposed seconds and MFU; none for a run the program would refuse to start."""
    if refused(p):
        return "- | - | -"
    return f"{p['step_s']:.3f} | {p['exposed_comm_s']:.3f} | {p['mfu_percent']:.1f}%"


def split_diloco(overrides):
    """The overrides of [diloco] keys apart from the rest: the layouts without DiLoCo refuse them."""
    rest, diloco, i = [], [], 0
    while i < len(overrides):
        takes_value = "=" not in overrides[i] and i + 1 < len(overrides) and not overrides[i + 1].startswith("--")
        item = overrides[i:i + 2] if takes_value else overrides[i:i + 1]
        (diloco if overrides[i].startswith("--diloco.") else rest).extend(item)
        i += len(item)
    return rest, diloco


def failures(args, link, overrides):
    """Elastic DiLoCo (src/diloco/membership.h), one node lost in a period of H steps, then back:
    - the survivors wait, at the outer step after the loss: not at all for a node whose processes
      died (their connections to diloco_peers close), at most timeout_s for a hung one (its
      heartbeat silent that long; less when the hang came steps before the outer step);
    - the lost node's inner steps since the last outer step are gone: H/2 steps of a node on average;
    - its return as a fresh joiner: it takes the outer copies and momentum, 8 bytes a parameter, over
      the node's inter-node link (every GPU of the node fetching its shard at once) from one member,
      which sends before its next step, so that the next outer step waits that long for it."""
    print(f"assumptions: {args.inter_gbps * args.gpus_per_node * 8:g} Gbit/s per node across nodes, "
          f"timeout_s {args.timeout_s:g}, compute at {args.compute_efficiency:.0%} of peak")
    print("| model | H | nodes | step s | survivors' wait for a hang, at most s | lost work (node-s, mean) | "
          "rejoin transfer s | time lost per hang and return, at most s |")
    print("|---|---|---|---|---|---|---|---|")
    for config in args.config:
        run = run_of(args.train, config, overrides, args.gpus_per_node)
        params = run["num_params"]
        transfer = 8 * params / (args.inter_gbps * 1e9 * args.gpus_per_node)
        for h in args.diloco or [100]:
            for n in [n for n in args.nodes if n >= 2]:
                p = predict(args.train, config, overrides, run, n, args.gpus_per_node, True, link,
                            args.compute_efficiency, h)
                print(f"| {run['name_model']} | {h} | {n} | {p['step_s']:.3f} | {args.timeout_s:g} | "
                      f"{h / 2 * p['step_s']:.0f} | {transfer:.0f} | {args.timeout_s + transfer:.0f} |")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="the train_fsdp program (train_ddp beside it for --ddp)")
    ap.add_argument("--config", required=True, nargs="+", help="the run's TOML config(s)")
    ap.add_argument("--bytes", action="store_true", help="print one rank's bytes per step as JSON")
    ap.add_argument("--world", type=int, help="with --bytes: ranks")
    ap.add_argument("--shard", type=int, help="with --bytes: ranks per shard group (default: all)")
    ap.add_argument("--rank", type=int, default=0, help="with --bytes: whose bytes")
    ap.add_argument("--ddp", action="store_true", help="with --bytes: train_ddp")
    ap.add_argument("--tp", type=int, nargs="+", default=[1],
                    help="tensor-parallel degrees (within a node): table rows for each; with --bytes the first")
    ap.add_argument("--cp", type=int, nargs="+", default=[1],
                    help="context-parallel degrees (within a node): table rows for each; with --bytes the first")
    ap.add_argument("--ep", type=int, nargs="+", default=[1],
                    help="expert parallelism: ranks of a shard group splitting a mixture's experts (one row set each)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 8, 32, 64])
    ap.add_argument("--compute-efficiency", type=float, default=0.5, help="fraction of peak the math runs at")
    ap.add_argument("--intra-gbps", type=float, default=H100["intra_bw"] / 1e9, help="GB/s per GPU within a node")
    ap.add_argument("--inter-gbps", type=float, default=H100["inter_bw"] / 1e9, help="GB/s per GPU across nodes")
    ap.add_argument("--inter-latency-ms", type=float, default=H100["inter_lat"] * 1e3,
                    help="latency of a hop across nodes")
    ap.add_argument("--diloco", type=int, nargs="*", default=[], metavar="H",
                    help="add DiLoCo rows over the nodes, an outer step every H steps (the config's other "
                         "[diloco] keys, or overrides, apply)")
    ap.add_argument("--failures", action="store_true",
                    help="with --diloco: what one lost replica (node) costs elastic DiLoCo (diloco.peers), and its "
                         "return as a joiner")
    ap.add_argument("--timeout-s", type=float, default=60, help="with --failures: runtime.timeout_s, the heartbeat limit")
    ap.add_argument("overrides", nargs=argparse.REMAINDER, help="-- then the program's own --key value overrides")
    args = ap.parse_args()
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if args.bytes:
        tp, cp, ep = args.tp[0], args.cp[0], args.ep[0]
        plan = step_plan(args.train, args.config[0], overrides, args.world, args.shard or args.world // tp, args.ddp,
                         args.rank, tp=tp, cp=cp, ep=ep)
        bytes_ = plan["counted_bytes"]
        if plan.get("diloco"):  # the outer exchanges, over a period of inner_steps steps
            d = plan["diloco"]
            bytes_["diloco"] = {k: d[k] for k in ("replicate_bytes_per_period", "replicate_bytes_per_step")}
            # A step in which every fragment takes its outer step: the exchanges and the norm's sum.
            outer = {}
            for e in [x for events in d["exchanges"] for x in events] + d["norm"]:
                outer.setdefault(e["group"], {}).setdefault(e["kind"], 0)
                outer[e["group"]][e["kind"]] += e["counted"]
            bytes_["diloco"]["outer_step"] = outer
        print(json.dumps(bytes_, indent=1))
        return 0
    link = dict(H100, intra_bw=args.intra_gbps * 1e9, inter_bw=args.inter_gbps * 1e9,
                inter_lat=args.inter_latency_ms / 1e3)
    print(f"assumptions: {link['peak'] / 1e12:.0f} TFLOP/s peak at {args.compute_efficiency:.0%}, "
          f"{args.intra_gbps:g} GB/s in a node, {args.inter_gbps:g} GB/s per GPU across nodes, "
          f"{link['intra_lat'] * 1e6:g}/{link['inter_lat'] * 1e6:g} us latency, {args.gpus_per_node} GPUs a node")
    overrides, diloco_overrides = split_diloco(overrides)
    if args.failures:
        return failures(args, link, overrides + diloco_overrides)
    notes = []
    print("| model | layout | nodes | GPUs | batch/GPU/step | reduced | peak/GPU | step s | exposed comm s | MFU | GB/step/GPU in node | GB/step/GPU across |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config in args.config:
        run = run_of(args.train, config, overrides, args.gpus_per_node)
        layouts = [("FSDP", False, 0), ("HSDP", True, 0)] + [(f"DiLoCo H={h}", True, h) for h in args.diloco]
        for (name, hsdp, inner_steps), tp, cp, ep in [(l, t, c, e) for e in args.ep for c in args.cp for t in args.tp
                                                      for l in layouts]:
            if tp > 1:
                name = f"TP {tp} x {name}"
            if cp > 1:
                name = f"CP {cp} x {name}"
            if ep > 1:
                name = f"EP {ep} x {name}"
            for n in args.nodes:
                if hsdp and n == 1:
                    continue
                if ((args.gpus_per_node if hsdp or inner_steps else n * args.gpus_per_node) // tp) % ep:
                    continue  # EP within a shard group: it must divide it
                p = predict(args.train, config, overrides + (diloco_overrides if inner_steps else []), run, n,
                            args.gpus_per_node, hsdp, link, args.compute_efficiency, inner_steps, tp, cp, ep)
                if inner_steps and not refused(p):
                    notes.append(f"{name} on {n} nodes: the outer exchanges expose {p['outer_s']:.3f} s per step")
                print(f"| {run['name_model']} | {name} | {n} | {p['world']} | "
                      f"{run['batch_size'] * run['seq_length'] // args.gpus_per_node:,} tokens | "
                      f"{'every micro-batch' if p['reduce_every_micro_batch'] else 'last micro-batch'} | "
                      f"{peak_text(p['memory'])} | {timing_text(p)} | {p['bytes_intra'] / 1e9:.2f} | "
                      f"{p['bytes_inter'] / 1e9:.2f} |")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
