"""The step plan's bytes (train_fsdp --print-plan, read by scripts/perf/scale_model.py) against what
real runs measure, on 4 Gloo ranks over loopback: FSDP over 4, HSDP 2x2 and 1x4 (Muon split over
the replicas) and train_ddp on 4 (rank 0's record, every kind of collective, by group under HSDP),
DiLoCo 2x2 with an outer step every step (the inner step's bytes plus the outer step's), TP 2 x
FSDP 2 (Muon, by group: shard and TP) and CP 2 x FSDP 2, keys and values gathered or passed around
the ring (by group: CP), FSDP over 4 gathering its FP8 weights in FP8, and a mixture of experts
with EP 2 x FSDP 2 (by group: expert_shard; its all-to-alls follow the routing, and the plan's are
a balanced one's, so the total leaves out all-to-alls). They must be equal, not close."""
import json
import subprocess

from conftest import DEBUG_CONFIG, PYTHON, SMALL, SOURCE, TRAIN_DDP, TRAIN_FSDP, metrics, run_ranks

SHORT = ["--optim.total_steps", "2", "--wandb", "false"]
# layout: (the run's arguments, scale_model.py's, the groups compared beyond the total)
LAYOUTS = {
    "fsdp": ([], [], []),
    "hsdp": (["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2"], ["--shard", "2"], ["shard", "replicate"]),
    "hsdp1x4": (["--parallel.dp_shard", "1", "--parallel.dp_replicate", "4"], ["--shard", "1"], ["shard", "replicate"]),
    "ddp": ([], ["--ddp"], []),
    "diloco": (["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2", "--diloco.inner_steps", "1"],
               ["--shard", "2"], ["shard", "replicate"]),
    "tp": (["--parallel.tp", "2"], ["--tp", "2"], ["shard", "tp"]),
    "cp": (["--parallel.cp", "2"], ["--cp", "2"], ["cp"]),
    "cp_ring": (["--parallel.cp", "2", "--parallel.cp_rotate", "ring"], ["--cp", "2"], ["cp"]),
    "float8": (["--float8.enable_float8_linear", "true", "--float8.emulate", "true",
                "--float8.enable_fsdp_float8_all_gather", "true"], [], []),
    "ep": (["--model.num_experts", "4", "--model.top_k", "2", "--model.moe_inter_dim", "64", "--parallel.ep", "2"],
           ["--ep", "2"], ["expert_shard"]),
}


def test_bytes_match_measured(work):
    bad = []
    for name, (extra, model_args, groups) in LAYOUTS.items():
        run_ranks(4, work / f"{name}.log", *SMALL, *SHORT, *extra, "--logging.metrics_file", work / f"{name}.jsonl",
                  program=TRAIN_DDP if name == "ddp" else TRAIN_FSDP)
        # SMALL without its --config: scale_model.py names the config itself.
        diloco = ["--diloco.inner_steps", "1"] if name == "diloco" else []
        diloco += ["--parallel.cp_rotate", "ring"] if name == "cp_ring" else []
        diloco += extra if name in ("float8", "ep") else []
        out = subprocess.run([PYTHON, SOURCE / "scripts/perf/scale_model.py", "--train", TRAIN_FSDP, "--config",
                              DEBUG_CONFIG, "--bytes", "--world", "4", *model_args, "--", *SMALL[2:], *SHORT, *diloco],
                             stdout=subprocess.PIPE, text=True)
        assert out.returncode == 0, f"scale_model {name}"
        model = json.loads(out.stdout)
        record = metrics(work / f"{name}.jsonl")[-1]
        if "diloco" in model:  # every step an outer step: its bytes on top of the inner step's
            for group, kinds in model["diloco"]["outer_step"].items():
                for total in (group, "total"):
                    for kind, b in kinds.items():
                        model.setdefault(total, {})[kind] = model.get(total, {}).get(kind, 0) + b
        for ours in ["total", *groups]:
            theirs = "comm_bytes" if ours == "total" else f"comm_bytes_{ours}_group"
            compared = lambda k, v: v and not (name == "ep" and k == "all_to_all")  # noqa: E731
            measured = {k: v for k, v in record[theirs].items() if compared(k, v)}
            predicted = {k: v for k, v in model.get(ours, {}).items() if compared(k, v)}
            print(f"{name} {ours}: measured {measured}, model {predicted}")
            if measured != predicted:
                bad.append(f"{name} {ours}")
        assert not bad, f"bytes differ: {bad}"
