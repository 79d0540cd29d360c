"""train_fsdp end to end: one process, real launchers (torchrun, mpirun, two torchrun "nodes" for
train_hsdp) and real failures (a rank killed, a rank hung, mismatched world sizes, no master).
The config is the debug preset (configs/debug/normal.toml: 4 steps, fake data, vocabulary 1024)."""
import math
import re
import signal
import time

from conftest import (DEBUG_CONFIG, TORCHRUN, TRAIN_FSDP, TRAIN_HSDP, free_port, metrics, run, start,
                      start_ranks, wait_for, text_of)

# A later --logging.metrics_file overrides this one. Newton-Schulz in fp32: bf16 matrix products on
# a CPU without native bf16 instructions (AVX2 only) run about 75 times slower, and these tests are
# about launching, not precision.
COMMON = ["--config", DEBUG_CONFIG, "--runtime.device", "cpu", "--runtime.num_threads", "1",
          "--logging.metrics_file", "/dev/null", "--optim.optim.ns_dtype", "float32"]
LONG = ["--optim.total_steps", "100000"]  # a run that only stops when it fails
# Rows of 256 tokens where the preset's shape is beside the point (a killed or hung rank): a
# quarter of a step's time.
SHORT_ROWS = ["--data.seq_length", "256"]


def check_run(path):
    """The metrics file of a finished run of the preset: one record per step 1..4, finite losses."""
    records = metrics(path)
    steps, losses = [r["step"] for r in records], [r["loss"] for r in records]
    print("steps", steps, "losses", losses)
    assert steps == [1, 2, 3, 4], f"steps {steps}, expected 1..4"
    assert all(math.isfinite(x) for x in losses), f"losses {losses}"
    # Every record names the attention kernel that ran: the preset's documents on the CPU go through
    # scaled_dot_product_attention with a mask, whose CPU kernels are flash's or the unfused one.
    kernels = {r.get("attention_kernel") for r in records}
    print("attention kernels", kernels)
    assert len(kernels) == 1 and kernels <= {"flash_attention", "math"}, f"attention_kernel {kernels}"


def same_losses(one, other, label):
    """The same global batches in fp32: at most the order of summation differs. A reordered fp32
    sum differs by ~1e-7 relative, and 3 optimizer steps can amplify that; 1e-5 relative (7e-5 at
    a loss of 7.4) allows it, while a real fault (a lost or doubled micro-batch changes step 1 by
    ~0.01, the sampling noise of the batch) is far above it."""
    a, b = ([r["loss"] for r in metrics(p)] for p in (one, other))
    assert len(a) == len(b) == 4, (a, b)
    for step, (x, y) in enumerate(zip(a, b), 1):
        print(f"step {step}: loss {x!r} on 1 process, {y!r} {label}, relative difference {abs(x - y) / abs(x):.1e}")
        assert abs(x - y) <= 1e-5 * abs(x), f"step {step}: {x} vs {y}"


def past_start_up(log):
    """Waits until rank 0 has logged step 2, both ranks past their start-up (which a busy machine
    can stretch to tens of seconds)."""
    assert wait_for(lambda: "step 2/" in text_of(log), 120, 0.2), f"rank 0 never reached step 2:\n{text_of(log)}"


def test_single_process(work):
    """The preset trains on one process, as a user runs it (ctest: cli.debug_preset_trains)."""
    rc, out = run(TRAIN_FSDP, *COMMON, "--logging.metrics_file", work / "metrics.jsonl")
    print(out)
    assert rc == 0, f"exited {rc}"
    check_run(work / "metrics.jsonl")
    first = metrics(work / "metrics.jsonl")[0]["loss"]
    # Fake data are uniform random tokens over the vocabulary of 1024, so no model does better than
    # ln 1024 = 6.93 in expectation; at initialisation the logits are random with a spread of about
    # one (the output layer's std is dim^-0.5), which costs about half of that squared more (7.42
    # with the preset's seed). A loss outside [ln 1024 - 0.5, ln 1024 + 1.5] means the model, the
    # data or the loss is off, not noise: 16 sequences of 1024 tokens make the sample mean's own
    # noise about 0.01.
    lo, hi = math.log(1024) - 0.5, math.log(1024) + 1.5
    print(f"loss at step 1: {first:.4f}, expected in [{lo:.2f}, {hi:.2f}]")
    assert lo <= first <= hi


def two_ranks_as_one(work, launcher):
    """2 ranks started by `launcher` train as one process does. Rows of 256 tokens rather than the
    preset's 1024: what is checked is the launch and the equality of the runs (a quarter of the
    time). One process runs 2 micro-batches of 8, two ranks one each; on CPU with Gloo the losses
    come out bit for bit equal today, but the bound does not rely on that."""
    common = COMMON + SHORT_ROWS
    rc, out = run(TRAIN_FSDP, *common, "--logging.metrics_file", work / "single.jsonl")
    assert rc == 0, f"the single process exited {rc}:\n{out}"
    two = work / "two.jsonl"  # written by rank 0
    rc, out = run(*launcher, TRAIN_FSDP, *common, "--logging.metrics_file", two)
    print(out)
    assert rc == 0, f"{launcher[0]} exited {rc}"
    assert "world: 2 process(es) via" in out, "not 2 ranks"
    check_run(work / "single.jsonl")
    check_run(two)
    same_losses(work / "single.jsonl", two, "on 2")
    return two


def test_torchrun(work):
    two = two_ranks_as_one(work, [TORCHRUN, "--standalone", "--nproc_per_node=2", "--no-python"])
    # The metrics record what moved and where the time went.
    r = metrics(two)[-1]
    print("last metrics record:", {k: r[k] for k in ("comm_bytes", "comm_wait_seconds", "forward_seconds",
                                                     "backward_seconds", "optimizer_seconds")})
    assert r["comm_bytes"]["all_gather"] > 0 and r["comm_bytes"]["reduce_scatter"] > 0
    assert r["comm_bytes"]["all_to_all"] > 0
    assert all(r[k] > 0 for k in ("forward_seconds", "backward_seconds", "optimizer_seconds"))


def test_mpirun(work):
    two_ranks_as_one(work, ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_ADDR=127.0.0.1",
                            "-x", f"MASTER_PORT={free_port()}"])


def test_hsdp_torchrun(work):
    """train_hsdp on two "nodes" of two ranks: two torchrun agents on loopback, started as two
    machines would start them (static rendezvous at node 0's address). Shard groups are the nodes,
    replicas across them; the run must equal one process on the same global batches."""
    small = ["--data.seq_length", "128", "--optim.batch_size", "8", "--train.micro_bs", "2"]
    rc, out = run(TRAIN_FSDP, *COMMON, *small, "--logging.metrics_file", work / "single.jsonl")
    assert rc == 0, f"the single process:\n{out}"
    port = free_port()
    nodes = [start([TORCHRUN, "--nnodes", "2", "--node_rank", node, "--nproc_per_node", "2", "--master_addr",
                    "127.0.0.1", "--master_port", port, "--no-python", TRAIN_HSDP, *COMMON, *small,
                    "--logging.metrics_file", work / "hsdp.jsonl"], work / f"node{node}.log")
             for node in (0, 1)]
    codes = [p.wait() for p in nodes]
    log0 = (work / "node0.log").read_text()
    print("\n".join([line for line in log0.splitlines() if not re.match(r"W[0-9]", line)
                     and any(w in line for w in ("hybrid", "world:", "step 4/4", "error"))][:10]))
    assert codes == [0, 0], f"exit codes {codes}\n{log0[-3000:]}\n{(work / 'node1.log').read_text()[-3000:]}"
    assert "hybrid sharding: parameters sharded over groups of 2 consecutive ranks, replicated 2 times" in log0, \
        "not sharded by node"
    same_losses(work / "single.jsonl", work / "hsdp.jsonl", "under HSDP 2x2")
    # Bytes by group: the gathers, reduce-scatters and Muon's exchange stay inside the shard group
    # (a node); only the all-reduce of the reduced rows crosses to the other replica. The step's
    # totals hold both plus the world's own all-reduce (the loss with the loop's flags).
    r = metrics(work / "hsdp.jsonl")[-1]
    shard, rep, total = r["comm_bytes_shard_group"], r["comm_bytes_replicate_group"], r["comm_bytes"]
    print("by group:", shard, rep)
    assert shard["all_gather"] > 0 and shard["reduce_scatter"] > 0 and shard["all_to_all"] > 0
    assert rep["all_reduce"] > 0 and rep["all_gather"] == rep["reduce_scatter"] == rep["all_to_all"] == 0
    # What crosses is each unit's reduced rows n (fp32): all-reduced over R = 2 replicas, 4(R-1)/R n
    # = 2n, as much as the reduce-scatter that made them over S = 2 ranks counted (2(S-1) n); and
    # Muon's results shared between the replicas (exact counts: test scale.bytes_match_measured).
    assert rep["all_reduce"] > shard["reduce_scatter"], (rep, shard)
    for k in total:
        assert total[k] >= shard[k] + rep[k], k
    assert total["all_gather"] == shard["all_gather"] and total["reduce_scatter"] == shard["reduce_scatter"]
    # One node has nothing to replicate across.
    rc, out = run(TORCHRUN, "--standalone", "--nproc_per_node", "2", "--no-python", TRAIN_HSDP, *COMMON, *small)
    assert "all 2 rank(s) are on one node (LOCAL_WORLD_SIZE = WORLD_SIZE = 2): use train_fsdp" in out, \
        f"one node was not refused:\n{out[-2000:]}"


def test_killed_rank(work):
    """Two ranks on a long run; rank 1 is killed with SIGKILL after its first steps. Rank 0 must
    exit non-zero with a clear message well within the timeout."""
    ranks = start_ranks(2, work / "k.log", *COMMON, *SHORT_ROWS, *LONG, "--runtime.timeout_s", "30")
    past_start_up(work / "k.log.0")
    ranks.procs[1].kill()
    start_time = time.monotonic()
    rc = ranks.procs[0].wait()
    took = time.monotonic() - start_time
    log0 = ranks.text(0)
    print(log0)
    print(f"rank 0 exited {rc}, {took:.0f}s after rank 1 was killed")
    assert rc != 0, "rank 0 exited 0"
    assert took <= 41, "took longer than the timeout"
    assert "rank 0 failed in step" in log0, "no clear message"


def test_hung_rank(work):
    """Rank 1 stops (SIGSTOP) after its first steps and never answers: rank 0 must exit non-zero
    within runtime.timeout_s plus a little, naming the step that stalled (the watchdog's path, the
    one NCCL runs depend on: their waits do not block the host). Rank 1, once resumed, finds its
    own limit long passed and exits non-zero too."""
    ranks = start_ranks(2, work / "hung.log", *COMMON, *SHORT_ROWS, *LONG, "--runtime.timeout_s", "8")
    past_start_up(work / "hung.log.0")
    ranks.procs[1].send_signal(signal.SIGSTOP)
    start_time = time.monotonic()
    rc0 = ranks.procs[0].wait()
    took = time.monotonic() - start_time
    ranks.procs[1].send_signal(signal.SIGCONT)
    rc1 = ranks.procs[1].wait()
    print(ranks.text(0), ranks.text(1))
    print(f"rank 0 exited {rc0}, {took:.0f}s after rank 1 stopped; rank 1 exited {rc1} once resumed")
    assert rc0 == 1 and rc1 != 0, f"exit codes {rc0} {rc1}"
    assert took <= 21, "took longer than the timeout and a margin"
    assert re.search(r"rank 0 failed in step [0-9]+: no collective with the other ranks completed for [0-9]+ s "
                     r"\(runtime.timeout_s = 8\)", ranks.text(0)), "no clear message on rank 0"
    assert "rank 1 failed in step" in ranks.text(1), "no clear message on rank 1"


def test_world_size_mismatch(work):
    # batch 48 / micro_bs 8 divides by 2 and 3 ranks, so both pass config validation.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    args = [TRAIN_FSDP, *COMMON, "--optim.batch_size", "48", "--runtime.timeout_s", "20"]
    procs = [start(args, work / f"{rank}.log", env={**env, "RANK": rank, "WORLD_SIZE": world})
             for rank, world in ((0, 2), (1, 3))]
    codes = [p.wait() for p in procs]
    log0, log1 = (work / "0.log").read_text(), (work / "1.log").read_text()
    print(log0, log1)
    assert codes[0] != 0 and codes[1] != 0, f"exit codes {codes}"
    assert "launched with world size 2 but rank 1 with 3" in log0, "rank 0 message"
    assert "launched with world size 3 but rank 0 with 2" in log1, "rank 1 message"


def test_unreachable_master(work):
    """Rank 1 of 2 with nobody serving the rendezvous: a clear error once runtime.timeout_s passes."""
    port = free_port()
    start_time = time.monotonic()
    rc, out = run(TRAIN_FSDP, *COMMON, "--runtime.timeout_s", "5",
                  env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": 1, "WORLD_SIZE": 2})
    took = time.monotonic() - start_time
    print(out)
    print(f"exited {rc} after {took:.0f}s")
    assert rc != 0 and took <= 31
    assert f"rendezvous at 127.0.0.1:{port} failed within 5 s" in out, "message"
