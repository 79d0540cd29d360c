"""Profiling (observe/profiler.h, util/phase.h) on 2 Gloo ranks of the debug model, 4 steps, a window
of 1 step every 2 (steps 2 and 4). Each rank writes, for each window, a Chrome trace that is valid
JSON holding the named phases of one whole step, nested and ordered as the step runs them, and a
summary with phases and operator counts; the losses equal those of the same run without profiling,
bit for bit."""
import json
import re

from conftest import SMALL, compare_losses, run_ranks

COMMON = SMALL + ["--optim.total_steps", "4", "--ckpt.path", "", "--data.eval_interval", "0"]


def check_trace(stem, it):
    """One rank's trace and summary of the window at step `it`."""
    events = json.load(open(stem + "_trace.json"))["traceEvents"]  # valid JSON, Chrome's format
    zb = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("zb.")]
    # Nesting by time on the step's thread: a phase's parent is the innermost one around it.
    step = [e for e in zb if e["name"] == f"zb.step {it}"]
    assert len(step) == 1, (stem, "one zb.step", [e["name"] for e in zb][:20])
    step = step[0]

    def inside(e, p):
        return p["ts"] <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"] and e is not p
    mine = sorted([e for e in zb if e["tid"] == step["tid"] and inside(e, step)], key=lambda e: e["ts"])

    def children(p):
        kids = [e for e in mine if inside(e, p)]
        return [e for e in kids if not any(inside(e, q) for q in kids)]

    def names(es):
        return [e["name"] for e in es]
    # The step: 6 micro-batches (24 sequences, 2 ranks, micro_bs 2), then clipping, the update.
    top = names(children(step))
    assert top[:6] == [f"zb.micro_batch {m}" for m in range(6)] and top[6] == "zb.clip" and \
        top[-1] == "zb.optimizer", top
    for mb in children(step)[:6]:
        assert names(children(mb)) == ["zb.data", "zb.forward", "zb.backward"], names(children(mb))
    mb0 = children(step)[0]
    forward = children(mb0)[1]
    blocks = [n for n in names(children(forward)) if n.startswith("zb.block_forward")]
    assert blocks == ["zb.block_forward 0", "zb.block_forward 1"], names(children(forward))
    f = names(children(forward))
    # Each block's parameters are gathered (waited for) before it runs; the loss comes last.
    assert f.index("zb.fsdp.wait_unshard layers.0") < f.index("zb.block_forward 0") < \
        f.index("zb.fsdp.wait_unshard layers.1") < f.index("zb.block_forward 1") < f.index("zb.loss"), f
    assert "zb.loss_chunk 0" in names(children(children(forward)[f.index("zb.loss")]))
    # The last micro-batch reduces: each unit's post-backward reduce-scatters, in backward's order
    # (the root, holding the embedding, completes last).
    last_backward = names([e for e in mine if inside(e, children(children(step)[5])[2])])
    posts = [n for n in last_backward if n.startswith("zb.fsdp.post_backward")]
    assert posts == ["zb.fsdp.post_backward layers.1", "zb.fsdp.post_backward layers.0",
                     "zb.fsdp.post_backward root"], posts
    assert "zb.fsdp.reduce_scatter layers.0" in last_backward, last_backward
    # Muon on the sharded matrices: rows to the owners, Newton-Schulz, rows back; AdamW.
    opt = names([e for e in mine if inside(e, children(step)[-1])])
    assert opt.count("zb.muon.all_to_all") == 2 and "zb.muon.newton_schulz" in opt and "zb.adamw" in opt, opt
    assert opt.index("zb.muon.newton_schulz") < opt.index("zb.muon.all_to_all", opt.index("zb.muon.all_to_all") + 1)
    summary = json.load(open(stem + "_summary.json"))
    assert summary["first_step"] == summary["last_step"] == it and summary["ops_per_step"] > 100, summary
    phases = {p["name"]: p for p in summary["phases"]}
    assert phases["zb.micro_batch"]["count_per_step"] == 6 and phases["zb.block_forward"]["count_per_step"] == 12
    assert phases["zb.forward"]["seconds_per_step"] > 0 and summary["top_ops"], summary
    assert summary["exposed_comm_seconds_per_step"] == phases["zb.wait"]["seconds_per_step"] > 0, summary
    print(f"{stem}: {len(zb)} phases, step: {top}; {summary['ops_per_step']} ops/step")


def test_traces_and_phases(work):
    run_ranks(2, work / "plain.log", *COMMON, "--logging.metrics_file", work / "plain/metrics.jsonl")
    ranks = run_ranks(2, work / "prof.log", *COMMON, "--logging.metrics_file", work / "prof/metrics.jsonl",
                      "--profiling.enable_profiling", "true", "--profiling.profile_freq", "2",
                      "--profiling.profile_active", "1")
    print(ranks.text(0))
    compare_losses(work / "plain/metrics.jsonl", work / "prof/metrics.jsonl", 0, "profiled against plain", 1, 4)
    assert re.search(r"profile of steps 2-2: .* s blocked on collectives\), .* operators dispatched per step",
                     ranks.text(0)), "no profile summary in the log"
    for it in (2, 4):
        for rank in (0, 1):
            check_trace(f"{work}/prof/profile_traces/iteration_{it}/rank{rank}", it)
