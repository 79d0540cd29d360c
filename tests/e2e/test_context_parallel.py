"""Context parallelism (parallel.cp) end to end with real processes, against the single process.

The debug model at dim 128 on rows of 64 tokens, a vocabulary of 32: the fake data's uniform
tokens then close a document about every 32 tokens (the document token is one of 32), so rows
hold documents shorter than a chunk (16 tokens under cp 2, 8 under cp 4), longer than one, and
crossing the chunks' boundaries. Every layout trains the same global batches as one process; each
step's loss and gradient norm must agree within 1e-5 relative (fp32: the order of summation alone;
a token counted twice or a wrong mask moves step 1 by ~1e-2).

layouts: cp 2 and cp 4 with the document mask, cp 2 with the causal mask, cp 2 x FSDP 2, HSDP
  (2 replicas) of cp 2, and cp 2 x TP 2 (Muon gathering TP-split matrices to owners); the CP
  group's traffic is counted apart.
ring: the keys and values passed around the group (parallel.cp_rotate = "ring") at cp 2 and 4.
diloco: DiLoCo's 2 replicas each a CP group of 2 (streaming, 2 fragments), as DiLoCo's 2 replicas
  of one rank.
resume: a cp 2 checkpoint resumes at cp 4 and follows the straight cp 2 run.
"""
from conftest import SMALL, compare_losses, metrics, run_ranks

CP = SMALL + ["--data.seq_length", "64", "--optim.batch_size", "8", "--optim.total_steps", "8",
              "--optim.warmup_steps", "3", "--model.vocab_size", "32", "--ckpt.path", ""]


def same_run(work, ref, name):
    compare_losses(work / f"{ref}.jsonl", work / f"{name}.jsonl", 1e-5, name, 1, 8)
    want = {r["step"]: r["grad_norm"] for r in metrics(work / f"{ref}.jsonl")}
    got = {r["step"]: r["grad_norm"] for r in metrics(work / f"{name}.jsonl")}
    worst = max(abs(got[s] - want[s]) / want[s] for s in want)
    print(f"{name}: gradient norms, largest relative difference {worst:.2e} (allowed 1e-05)")
    assert worst <= 1e-5, f"{name}: gradient norms differ"


def train(work, name, world, *args):
    return run_ranks(world, work / f"{name}.log", *CP, "--logging.metrics_file", work / f"{name}.jsonl", *args)


def test_layouts(work):
    one = train(work, "one", 1)
    assert "within documents" in one.text(0), "the document mask is not on"
    ranks = train(work, "cp2", 2, "--parallel.cp", "2")
    assert "context parallelism: groups of 2 ranks" in ranks.text(0), "no CP in the log"
    same_run(work, "one", "cp2")
    train(work, "cp4", 4, "--parallel.cp", "4")
    same_run(work, "one", "cp4")
    train(work, "cp2_fsdp2", 4, "--parallel.cp", "2")
    same_run(work, "one", "cp2_fsdp2")
    train(work, "cp2_hsdp", 4, "--parallel.cp", "2", "--parallel.dp_shard", "1", "--parallel.dp_replicate", "2")
    same_run(work, "one", "cp2_hsdp")
    train(work, "cp2_tp2", 4, "--parallel.cp", "2", "--parallel.tp", "2")
    same_run(work, "one", "cp2_tp2")
    train(work, "one_causal", 1, "--model.attention", "causal")
    train(work, "cp2_causal", 2, "--parallel.cp", "2", "--model.attention", "causal")
    same_run(work, "one_causal", "cp2_causal")
    # What the CP group moves: each block's keys and values gathered, their gradients reduce-scattered.
    r = metrics(work / "cp2_fsdp2.jsonl")[0]
    print("cp group bytes:", r["comm_bytes_cp_group"])
    assert r["comm_bytes_cp_group"]["all_gather"] > 0 and r["comm_bytes_cp_group"]["reduce_scatter"] > 0


def test_resume(work):
    every_4 = ["--ckpt.interval", "4", "--ckpt.keep", "0"]
    train(work, "cp2", 2, "--parallel.cp", "2", "--ckpt.path", work / "ckpt", *every_4)
    train(work, "cp4", 4, "--parallel.cp", "4", "--ckpt.path", work / "ckpt4", "--ckpt.resume",
          work / "ckpt/step_00000004")
    compare_losses(work / "cp2.jsonl", work / "cp4.jsonl", 1e-5, "cp2_to_cp4", 5, 8)


def test_ring(work):
    train(work, "one", 1)
    for cp in (2, 4):
        train(work, f"ring{cp}", cp, "--parallel.cp", str(cp), "--parallel.cp_rotate", "ring")
        same_run(work, "one", f"ring{cp}")
    # Around the ring: all-to-alls with the next rank, no gathers of keys and values.
    r = metrics(work / "ring4.jsonl")[0]["comm_bytes_cp_group"]
    print("cp group bytes around the ring:", r)
    assert r["all_to_all"] > 0 and r["all_gather"] == 0 and r["reduce_scatter"] == 0, r


def test_diloco(work):
    diloco = ["--diloco.inner_steps", "4", "--diloco.fragments", "2", "--diloco.fragment_delay", "1",
              "--parallel.dp_replicate", "2"]
    train(work, "diloco", 2, *diloco)
    train(work, "diloco_cp2", 4, *diloco, "--parallel.cp", "2")
    same_run(work, "diloco", "diloco_cp2")
