"""scripts/perf/bench.sh end to end on a tiny run: train_fsdp and the PyTorch FSDP2 peers (ZeroBand's
muon-fsdp2 and torch.optim.Muon) on 2 Gloo ranks, 4 steps each. Checks the report has every row with
real numbers, that all sides moved the same number of bytes in their gradient reduce-scatters (the
same parameters sharded by rows in fp32): an independent check of our communication accounting
against PyTorch's collectives; and that ZeroBand's Muon gathered and scattered each matrix once
(its bytes per step from the matrices' sizes). Then a peer that cannot run (muon-fsdp2 with 3 ranks:
256 rows do not split evenly) gives its reason in the report in place of numbers. Every side's last
step is profiled: operators dispatched per step. (TORCH_COMPILE_DISABLE: muon-fsdp2's Newton-Schulz
eagerly; compiling it takes a minute here.)"""
import json
import math
import subprocess

from conftest import PYTHON, SOURCE, TRAIN_FSDP, run


def test_smoke(work):
    # On CPU wherever it runs (two ranks would not find two GPUs on a one-GPU machine).
    env = {"OUT": work, "WARMUP": "1", "ZB_SKIP_BUILD": "1", "PEER_COMPILE": "0", "TRAIN_FSDP": TRAIN_FSDP,
           "PYTHON": PYTHON, "TORCH_COMPILE_DISABLE": "1"}
    rc, out = run(SOURCE / "scripts/perf/bench.sh", SOURCE / "configs/bench/cpu.toml", "2", "4", "--runtime.device", "cpu",
                  "--data.seq_length", "128", "--train.micro_bs", "2", "--optim.batch_size", "4", env=env)
    print(out)
    assert rc == 0, f"bench.sh exited {rc}"
    b = json.load(open(work / "bench.json"))
    ours, peer, torch_muon = (b["results"][k] for k in ("zeroband-cpp", "pytorch-zeroband-eager", "pytorch-torch-eager"))
    for name, r in b["results"].items():
        print(name, {k: r[k] for k in ("tokens_per_second_per_rank", "step_seconds", "peak_memory_bytes",
                                       "comm_bytes_per_step")})
        assert r["tokens_per_second_per_rank"] > 0 and r["step_seconds"] > 0 and r["peak_memory_bytes"] > 0
        assert math.isfinite(r["final_loss"]) and r["forward_seconds"] > 0 and r["backward_seconds"] > 0
    rs = [r["comm_bytes_per_step"]["reduce_scatter"] for r in (ours, peer, torch_muon)]
    assert rs[0] == rs[1] == rs[2] > 0, f"reduce-scatter bytes differ: ours {rs[0]}, PyTorch {rs[1:]}"
    # Rank 0 of 2 owns every other matrix (muon-fsdp2: matrix i on rank i % 2): for the ones it owns
    # it receives the other half of the gradient and sends half of the result back; for the others
    # it sends its half and receives its half. Either way each matrix moves half its fp32 size each
    # way.
    m = json.load(open(work / "run.json"))["model"]
    D, F, Q, K = m["dim"], m["ffn_hidden"], m["n_heads"] * m["head_dim"], m["n_kv_heads"] * m["head_dim"]
    half = 4 * m["n_layers"] * (2 * Q * D + 2 * K * D + 3 * F * D) // 2
    assert peer["comm_bytes_per_step"]["gather"] == half, (peer["comm_bytes_per_step"], half)
    assert peer["comm_bytes_per_step"]["scatter"] == half, (peer["comm_bytes_per_step"], half)
    assert "zeroband-cpp / pytorch-zeroband-eager" in b["ratios"] and "zeroband-cpp / pytorch-torch-eager" in b["ratios"]
    # Every side's last step profiled: operators dispatched per step, and left out of the timings.
    for name, r in b["results"].items():
        assert r["ops_dispatched_per_step"] > 100 and r["steps_measured"] == 1, (name, r)
    assert all(q["ops_dispatched"] > 0 for q in b["ratios"].values()), b["ratios"]

    rc, out = run(PYTHON, SOURCE / "scripts/perf/bench_peer.py", "--config-json", work / "run.json", "--steps", "2",
                  "--metrics-file", work / "uneven.jsonl", env={"RANK": "0", "WORLD_SIZE": "3"})
    assert rc == 0, f"bench_peer exited {rc}: {out}"
    report = subprocess.run([PYTHON, SOURCE / "scripts/perf/bench_report.py", "--config-json", work / "run.json",
                             "--world-size", "2", "--warmup", "1", "--out", work / "uneven.json",
                             f"zeroband-cpp={work}/zeroband-cpp.jsonl", f"pytorch-zeroband-eager={work}/uneven.jsonl"],
                            stdout=subprocess.PIPE, text=True)
    assert report.returncode == 0, f"bench_report exited {report.returncode}"
    assert "| pytorch-zeroband-eager | not run: muon-fsdp2 needs equal shards: wq (256 rows)" in report.stdout, \
        f"no reason in the report:\n{report.stdout}"


def test_moe(work):
    """The same on a mixture of experts (configs/moe/debug.toml, AdamW on every side: the one peer):
    the peer's mixture is a loop over 2-D experts with train_fsdp's routing and initial draws, so
    the first step's loss must be ours (same weights, same tokens to the same experts), and the
    reduce-scatters move the same bytes (the experts' rows, whole stacks or one Linear each)."""
    env = {"OUT": work, "WARMUP": "1", "ZB_SKIP_BUILD": "1", "PEER_COMPILE": "0", "TRAIN_FSDP": TRAIN_FSDP,
           "PYTHON": PYTHON, "TORCH_COMPILE_DISABLE": "1"}
    rc, out = run(SOURCE / "scripts/perf/bench.sh", SOURCE / "configs/moe/debug.toml", "2", "3", "--runtime.device", "cpu",
                  "--data.seq_length", "64", "--train.micro_bs", "2", "--optim.batch_size", "4",
                  "--optim.optim.type", "adamw", env=env)
    print(out)
    assert rc == 0, f"bench.sh exited {rc}"
    b = json.load(open(work / "bench.json"))
    ours, peer = b["results"]["zeroband-cpp"], b["results"]["pytorch-adamw-eager"]
    assert abs(ours["first_loss"] - peer["first_loss"]) < 1e-5, (ours["first_loss"], peer["first_loss"])
    rs = [r["comm_bytes_per_step"]["reduce_scatter"] for r in (ours, peer)]
    assert rs[0] == rs[1] > 0, f"reduce-scatter bytes differ: ours {rs[0]}, PyTorch {rs[1]}"
