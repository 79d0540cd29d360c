"""Runs that go wrong, with real processes (2 Gloo ranks): they stop cleanly, every rank with a
non-zero exit code, and no good checkpoint is lost. Non-finite gradients come from a test program
with a fault (tests/faulty_train.cpp), not from the training programs."""
import array
import filecmp
import glob
import math
import os
import re

from conftest import FAULTY_TRAIN, SMALL, by_step, compare_losses, digest, metrics, run_ranks, start_ranks


def all_finite(folder):
    """Every value of a checkpoint's rank files is finite."""
    for path in sorted(glob.glob(f"{folder}/rank_*.bin")):
        values = array.array("f", open(path, "rb").read())
        bad = sum(1 for v in values if not math.isfinite(v))
        assert not bad, f"{path}: {bad} non-finite values"
    print(f"{folder}: all values finite")


def failing_ranks(world, log, *args, **kwargs):
    """A run that must fail on every rank: each exits 1. Returns the ranks."""
    ranks = start_ranks(world, log, *args, **kwargs)
    codes = ranks.wait()
    assert codes == [1] * world, f"{log.name}: exit codes {codes}, expected {[1] * world}{ranks.tails()}"
    return ranks


def test_nonfinite_stop(work):
    """A learning rate that blows up: a run saves step 4, and its resume at AdamW lr 1e6 everywhere
    (checkpoints every 4 steps) diverges. The first step with a non-finite loss or gradient norm
    stops both ranks (exit 1) with one line naming the step and the last good checkpoint, step 4;
    nothing of the diverged state is saved; step 4 is untouched and resumes at a sane rate."""
    ck = work / "ck"
    adamw = ["--optim.optim.type", "adamw", "--ckpt.path", ck, "--ckpt.interval", "4", "--ckpt.keep", "0"]
    run_ranks(2, work / "a.log", *SMALL, *adamw, "--optim.total_steps", "4")
    before = digest(ck / "step_00000004")
    lr = "1e6"
    ranks = failing_ranks(2, work / "d.log", *SMALL, *adamw, "--ckpt.resume", "latest", "--optim.optim.lr", lr,
                          "--optim.adam.lr_embedding", lr, "--optim.adam.lr_head", lr, "--optim.adam.lr_norm", lr)
    print("\n".join(line for line in ranks.text(0).splitlines() if "error: step" in line))
    for r in (0, 1):
        assert re.search(r"error: step [5-8]: the (loss|gradient norm|loss and gradient norm) is not finite .* the step "
                         r"was not applied; stopping \(train.nonfinite = \"stop\"\); nothing saved; the last good "
                         + re.escape(f"checkpoint is {ck}/step_00000004"), ranks.text(r)), \
            f"rank {r}: no stop line naming the step and step_00000004"
    print(sorted(os.listdir(ck)))
    assert sorted(os.listdir(ck)) == ["latest", "step_00000004"], f"the checkpoint directory holds {os.listdir(ck)}"
    assert digest(ck / "step_00000004") == before, "step 4 changed"
    all_finite(ck / "step_00000004")
    ranks = run_ranks(2, work / "r.log", *SMALL, *adamw, "--ckpt.resume", "latest")
    assert f"resumed from {ck}/step_00000004" in ranks.text(0), "no resume"


def test_nonfinite_skip(work):
    """A NaN put into rank 1's reduced gradients at step 3 (the faulty test program): under "skip"
    both ranks skip the step (the gradient norm is all-reduced), and the state saved after step 3 is
    bit for bit the state after step 2 on every rank: parameters, momentum and Adam moments. The
    schedule does not advance over the skipped step, and a resume from a later checkpoint continues
    it exactly."""
    s = work / "s"
    ranks = run_ranks(2, work / "s.log", *SMALL, "--train.nonfinite", "skip", "--ckpt.path", s, "--ckpt.interval", "1",
                      "--ckpt.keep", "0", "--logging.metrics_file", work / "s.jsonl", program=FAULTY_TRAIN,
                      env={"ZB_TEST_NONFINITE_GRAD_STEPS": "3"})
    for r in (0, 1):
        assert re.search(r"step 3: the gradient norm is not finite \(loss [0-9.]*, gradient norm nan\), the step was "
                         r"not applied: skipped \(1 in a row, 1 in all", ranks.text(r)), f"rank {r} did not log the skip"
        assert filecmp.cmp(s / f"step_00000002/rank_0000{r}.bin", s / f"step_00000003/rank_0000{r}.bin",
                           shallow=False), f"rank {r}: step 3 changed the state"
    rec = {x["step"]: x for x in metrics(work / "s.jsonl")}
    assert rec[3]["nonfinite"] == "gradient norm" and rec[3]["grad_norm"] is None, rec[3]
    assert [rec[t]["skipped_steps"] for t in range(1, 9)] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert rec[4]["lr"] == rec[3]["lr"] != rec[2]["lr"], "the schedule advanced over the skipped step"
    print("step 3 skipped on both ranks; the state after it is the state after step 2; lr at 4 =",
          by_step(work / "s.jsonl", "lr")[4])
    run_ranks(2, work / "r.log", *SMALL, "--train.nonfinite", "skip", "--ckpt.path", work / "r", "--ckpt.resume",
              s / "step_00000004", "--logging.metrics_file", work / "r.jsonl")
    compare_losses(work / "s.jsonl", work / "r.jsonl", 0, "resumed after a skipped step")
    # train_ddp too: there each rank computes the norm from its own replica, and the step's
    # all-reduce carries whether any rank found it non-finite.
    ddp = work / "ddp"
    run_ranks(2, work / "ddp.log", *SMALL, "--train.nonfinite", "skip", "--ckpt.path", ddp, "--ckpt.interval", "1",
              "--optim.total_steps", "3", program=FAULTY_TRAIN,
              env={"ZB_TEST_PARALLELISM": "ddp", "ZB_TEST_NONFINITE_GRAD_STEPS": "3"})
    for r in (0, 1):
        assert filecmp.cmp(ddp / f"step_00000002/rank_0000{r}.bin", ddp / f"step_00000003/rank_0000{r}.bin",
                           shallow=False), f"train_ddp: step 3 changed rank {r}'s rows"
    # Too many in a row: train.max_skipped_steps = 2, non-finite at steps 3 and 4.
    m = work / "m"
    ranks = failing_ranks(2, work / "m.log", *SMALL, "--train.nonfinite", "skip", "--train.max_skipped_steps", "2",
                          "--ckpt.path", m, "--ckpt.interval", "1", program=FAULTY_TRAIN,
                          env={"ZB_TEST_NONFINITE_GRAD_STEPS": "3,4"})
    for r in (0, 1):
        assert re.search(r"error: step 4: the gradient norm is not finite .*; 2 such steps in a row "
                         r"\(train.max_skipped_steps\); nothing saved; the last good checkpoint is "
                         + re.escape(f"{m}/step_00000003"), ranks.text(r)), f"rank {r}: no stop after two skipped steps"


def test_unwritable_ckpt(work):
    """Found before step 1: a ckpt.path that cannot be created, and one rank that cannot write a
    file of 4 KiB (ulimit -f 1: its log still fits). Every rank exits 1 naming the problem."""
    (work / "a-file").touch()
    p = failing_ranks(2, work / "p.log", *SMALL, "--ckpt.path", work / "a-file/ckpt")
    assert (f"checkpoint directory (ckpt.path) is not writable: cannot create directory {work}/a-file/ckpt: "
            "Not a directory") in p.text(0), "no message naming the directory"
    q = failing_ranks(2, work / "q.log", *SMALL, "--ckpt.path", work / "q", limit_rank=1, limit_kb=1)
    assert re.search(r"not writable: writing [0-9]* bytes at offset [0-9]* of " +
                     re.escape(f"{work}/q/.write-test-rank_00001.tmp failed: File too large"), q.text(1)), \
        "rank 1: no message naming the file and the error"
    assert f"checkpoint directory (ckpt.path) {work}/q is not writable from 1 rank(s)" in q.text(0), "rank 0"
    assert "step 1/" not in p.text(0) and "step 1/" not in q.text(0), "trained before failing"


def test_short_write(work):
    """A save that fails midway on one rank (its file limited to 1 MiB, a rank's share is ~10 MiB):
    both ranks stop with exit 1, the message names the file and the OS error, the temporary
    directory is gone, and the previous checkpoint and `latest` are untouched."""
    ck = work / "ck"
    run_ranks(2, work / "a.log", *SMALL, "--ckpt.path", ck, "--optim.total_steps", "4")
    before = digest(ck / "step_00000004")
    ranks = failing_ranks(2, work / "b.log", *SMALL, "--ckpt.path", ck, "--ckpt.resume", "latest", "--ckpt.interval",
                          "2", limit_rank=1, limit_kb=1024)
    for r in (0, 1):
        assert re.search(r"saving the checkpoint failed: rank 1: writing [0-9]* bytes at offset [0-9]* of " +
                         re.escape(f"{ck}/.tmp-step_00000006/rank_00001.bin failed: File too large"), ranks.text(r)), \
            f"rank {r}: no message naming the file and the error"
    print(sorted(os.listdir(ck)))
    assert sorted(os.listdir(ck)) == ["latest", "step_00000004"], f"the checkpoint directory holds {os.listdir(ck)}"
    assert (ck / "latest").read_text().strip() == "step_00000004", "latest changed"
    assert digest(ck / "step_00000004") == before, "the previous checkpoint changed"


def test_publish_fails(work):
    """Every rank writes its files, then rank 0 fails to put the checkpoint into place (`latest.tmp`
    is a directory here): a failure only rank 0 sees. It is the run's last save, after which no
    step's flags would carry it: every rank must still exit 1 naming it, and `latest` stays absent."""
    ck = work / "ck"
    (ck / "latest.tmp/in-the-way").mkdir(parents=True)
    ranks = failing_ranks(2, work / "p.log", *SMALL, "--ckpt.path", ck, "--optim.total_steps", "2")
    for r in (0, 1):
        assert re.search(r"saving the checkpoint failed: rank 0: .*latest.tmp", ranks.text(r)), \
            f"rank {r}: no message naming the failure"
    assert not (ck / "latest").exists(), "latest was written"
