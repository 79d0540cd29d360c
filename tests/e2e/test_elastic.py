"""Elastic DiLoCo (diloco.peers, issue 52): replicas launched apart, meeting at diloco_peers, lose one
and train on without it.

Each test starts diloco_peers and one launch per replica (a process, or two ranks started with
torchrun's variables), one after the other so that launch r registers as replica r. The last
replica is lost in one of three ways:
  killed              its first rank sends itself SIGKILL after step 3 (ZB_TEST_KILL_AFTER_STEP):
                      diloco_peers sees its connection close ("died") at once
  hung                its first rank sends itself SIGSTOP after step 3 (ZB_TEST_STOP_AFTER_STEP) and
                      stays stopped until the others have finished: its heartbeat stops while its
                      connection stays open ("hung", after the timeout)
  killed_in_exchange  its first rank sends itself SIGKILL inside outer step 2's exchange, its group
                      made (ZB_TEST_KILL_IN_EXCHANGE): the others' exchange fails
  hung_in_exchange    the same with SIGSTOP (ZB_TEST_STOP_IN_EXCHANGE), a machine frozen there, while
                      the others come 2 s late to that exchange (ZB_TEST_LATE_TO_EXCHANGE): their
                      exchange times out runtime.timeout_s after it began, which is more than that
                      since their outer step began, and their own ranks' watchdog must not end them
(the first three at once, with replicas of one rank; the first and the last with two ranks). In each, the survivors finish every step, and their per-step losses equal
test_diloco.py's PyTorch reference in which the lost replica takes no part in the outer steps from
step 4's on, with the data rule of src/diloco/membership.h, within 1e-5; their final parameters
equal the reference's within 1e-4 (test_diloco.py says why), and their outer copies and momenta
each other's bit for bit (read from the checkpoints' files). Then: the survivor of 2 replicas of 2
ranks resumes exactly; joiners (one fresh, two at once with a peer's optimizer state) and a replica
restarted from its own checkpoint join and equal the reference; replicas sharded over different
numbers of ranks train together and take in a joiner of yet another layout; refusals.
"""
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import BUILD, free_port, start, stop_leftovers, wait_for
from test_diloco import INNER, STEPS, Runs, exported, reference

PEERS = BUILD / "apps" / "diloco_peers"
TIMEOUT_S = 3  # a replica without a heartbeat for this long is lost (diloco_peers and runtime.timeout_s)
SLACK_S = 20   # the same where no replica hangs: only a starved machine could reach it
ROWS = 2       # each replica's rows a step (optim.batch_size)
LOST_AT = 4    # the lost replica takes no part in the outer steps after this step and later


@pytest.fixture(scope="module")
def d():
    """test_diloco.py's runs, data, resolved config and initial weights, made once for the module
    (each test's runs have names of their own): (Runs, tokens, config, HF config, state dict)."""
    path = Path(tempfile.mkdtemp(prefix="zb_e2e_"))
    runs = Runs(path)
    tokens = runs.make_data()
    cfg = runs.resolved()
    hf_config, init = runs.make_model(cfg)
    yield runs, tokens, cfg, hf_config, init
    stop_leftovers()
    shutil.rmtree(path, ignore_errors=True)


def outer_state(step_dir):
    """A checkpoint's outer copies and momenta as its files hold them, each tensor's rows from every
    rank in row order: what replicas that agree share bit for bit, whatever their shard counts, read
    without a process of export_hf."""
    rows = {}
    for index in sorted(glob.glob(f"{step_dir}/rank_*.json")):
        data = open(index[:-len(".json")] + ".bin", "rb").read()
        for t in json.load(open(index)):
            if t["name"].startswith("diloco/"):  # fp32
                rows[(t["name"], t["row_start"])] = data[t["offset"]:t["offset"] + 4 * t["numel"]]
    if not rows:
        pytest.fail(f"{step_dir} holds no outer state")
    out = {}
    for name, _ in sorted(rows):
        out[name] = out.get(name, b"") + rows.pop((name, _))
    return out


def stopped(pid):
    """Whether process `pid` is stopped (SIGSTOP)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def start_run(runs, name, replicas, ranks, lose, others_env=None):
    """diloco_peers and `replicas` launches of `ranks` ranks, the last to be lost as `lose` says,
    the others with `others_env` (finish_run does the rest): (peers, launches)."""
    port = free_port()
    peers = start([PEERS, "--port", port, "--replicas", replicas, "--timeout_s", TIMEOUT_S],
                  f"{runs.tmp}/{name}_peers.log")
    hook = {"killed": {"ZB_TEST_KILL_AFTER_STEP": 3}, "hung": {"ZB_TEST_STOP_AFTER_STEP": 3},
            "killed_in_exchange": {"ZB_TEST_KILL_IN_EXCHANGE": 2}, "hung_in_exchange": {"ZB_TEST_STOP_IN_EXCHANGE": 2}}[lose]
    args = ["--diloco.inner_steps", INNER, "--diloco.peers", f"127.0.0.1:{port}", "--runtime.timeout_s", TIMEOUT_S,
            "--optim.batch_size", ROWS, "--train.micro_bs", ROWS // ranks, "--ckpt.interval", INNER]
    launches = []
    for r in range(replicas):
        launches.append(runs.launch(f"{name}_{r}", ranks, *map(str, args), env=hook if r == replicas - 1 else others_env))
        if not wait_for(lambda: f"DiLoCo: replica {r} of the run" in runs.log(f"{name}_{r}"), 60, 0.02):
            pytest.fail(f"{name}: launch {r} did not register as replica {r}:\n{runs.log(f'{name}_{r}')[-3000:]}")
    return peers, launches


def lose_replica(runs, name, replicas, ranks, lose, launches):
    """Waits until the last replica has stopped itself ("hung") or killed itself."""
    victim = launches[-1].procs[0] if ranks > 1 else launches[-1]
    lost = (lambda: stopped(victim.pid)) if lose.startswith("hung") else (lambda: victim.poll() is not None)
    if not wait_for(lost, 120, 0.02):
        pytest.fail(f"{name}: the last replica was never lost:\n{runs.log(f'{name}_{replicas - 1}')[-3000:]}")


def finish_run(runs, name, replicas, ranks, lose, peers, launches):
    """Waits for the survivors: each one's metrics records and final parameters, and the service's log."""
    tmp = runs.tmp
    victim = launches[-1].procs[0] if ranks > 1 else launches[-1]
    codes = [p.wait_or_stop() if ranks > 1 else p.wait() for p in launches[:-1]]
    victim.kill()  # the hung one, now that the others are done
    peers_code = peers.wait(timeout=60)
    peers_log = open(f"{tmp}/{name}_peers.log").read()
    if codes != [0] * (replicas - 1) or peers_code != 0:
        print(peers_log, "\n".join(runs.log(f"{name}_{r}")[-3000:] for r in range(replicas - 1)))
        pytest.fail(f"{name}: survivors' exit codes {codes}, diloco_peers' {peers_code}")
    return ([runs.records(f"{name}_{r}") for r in range(replicas - 1)],
            exported(f"{tmp}/{name}_0_ckpt/step_{STEPS:08d}"),
            [outer_state(f"{tmp}/{name}_{r}_ckpt/step_{STEPS:08d}") for r in range(replicas - 1)], peers_log)


def elastic_run(runs, name, replicas, ranks, lose):
    peers, launches = start_run(runs, name, replicas, ranks, lose)
    lose_replica(runs, name, replicas, ranks, lose, launches)
    return finish_run(runs, name, replicas, ranks, lose, peers, launches)


def check_survivors(name, records, params, outer, ref, replicas, reason):
    """params: the first survivor's final parameters; outer: each survivor's final outer state."""
    ref_losses, _, ref_params = ref
    survivors = list(range(replicas - 1))
    worst_loss = max(abs(rec["loss"] - ref_losses[rec["step"] - 1][q]) for q in survivors for rec in records[q])
    worst_param = max((params[k] - v).abs().max().item() for k, v in ref_params.items())
    changes = [(rec["step"], rec["membership"]) for rec in records[0] if "membership" in rec]
    members = [(rec["step"], rec["outer_step"]["members"]) for rec in records[0] if "outer_step" in rec]
    print(f"{name}: survivors' losses {[[round(r['loss'], 5) for r in rec] for rec in records]}; largest difference "
          f"from the reference: loss {worst_loss:.2e}, parameter {worst_param:.2e}; outer steps' members {members}; "
          f"membership changes {changes}")
    if any([r["step"] for r in rec] != list(range(1, STEPS + 1)) for rec in records):
        pytest.fail(f"{name}: a survivor did not record every step")
    if members != [(2, list(range(replicas)))] + [(s, survivors) for s in range(LOST_AT, STEPS + 1, INNER)]:
        pytest.fail(f"{name}: the outer steps' members are not as the losses imply")
    if len(changes) != 2 or changes[1][0] != LOST_AT or changes[1][1]["generation"] != 2 or \
            f"replica {replicas - 1} lost" not in changes[1][1]["change"] or f"({reason}: " not in changes[1][1]["change"]:
        pytest.fail(f"{name}: the membership change is not recorded as it happened")
    if worst_loss > 1e-5 or worst_param > 1e-4:
        pytest.fail(f"{name}: the survivors differ from the reference")
    if any(o != outer[0] for o in outer):
        pytest.fail(f"{name}: the survivors end on different models")


def test_three_replicas_lose_one(d):
    """3 replicas of 1 rank: the third killed mid-period, hung mid-period, killed inside an exchange."""
    runs, tokens, cfg, hf_config, init = d
    ref = reference(cfg, hf_config, init, tokens, 3, "muon", 0.7, 0.9, rows=ROWS, lost={2: LOST_AT})
    # The three runs at once: each waits seconds for its loss to be decided.
    losses = ("killed", "hung", "killed_in_exchange")
    started = {lose: start_run(runs, lose, 3, 1, lose) for lose in losses}
    for lose in losses:
        lose_replica(runs, lose, 3, 1, lose, started[lose][1])
    for lose in losses:
        records, params, outer, peers_log = finish_run(runs, lose, 3, 1, lose, *started[lose])
        check_survivors(lose, records, params, outer, ref, 3, "hung" if lose == "hung" else "died")
        print(f"{lose}: {records[0][LOST_AT - 1]['membership']['seconds_lost']:.2f} s from the survivors' arrival at "
              f"outer step 2 to their new membership\n{peers_log}")
        latest = f"{runs.tmp}/{lose}_2_ckpt/latest"  # its save of step 2 may not have finished
        if lose == "killed_in_exchange" and os.path.exists(latest) and open(latest).read().strip() != \
                f"step_{INNER:08d}":
            pytest.fail("the replica killed inside outer step 2 has a checkpoint after it")


def test_two_replicas_of_two_ranks_lose_one(d):
    """2 replicas of 2 ranks, the second's first rank killed mid-period, or frozen inside an
    exchange: the first trains on alone. The first run's checkpoint of step 4 then resumes (a new
    diloco_peers, the run's stream where the checkpoint left it) to the same losses and final
    parameters, bit for bit."""
    runs, tokens, cfg, hf_config, init = d
    ref = reference(cfg, hf_config, init, tokens, 2, "muon", 0.7, 0.9, rows=ROWS, lost={1: LOST_AT})
    cases = {"two_ranks": "killed", "two_ranks_hung_in_exchange": "hung_in_exchange"}
    late = {"two_ranks_hung_in_exchange": {"ZB_TEST_LATE_TO_EXCHANGE": 2}}
    started = {name: start_run(runs, name, 2, 2, lose, late.get(name)) for name, lose in cases.items()}
    for name, lose in cases.items():
        lose_replica(runs, name, 2, 2, lose, started[name][1])
    for name, lose in cases.items():
        records, params, outer, _ = finish_run(runs, name, 2, 2, lose, *started[name])
        check_survivors(name, records, params, outer, ref, 2, "died" if lose == "killed" else "hung")
        if name == "two_ranks":
            first = records, outer
    records, outer = first

    port = free_port()
    peers = start([PEERS, "--port", port, "--replicas", 1, "--timeout_s", TIMEOUT_S], f"{runs.tmp}/resumed_peers.log")
    resumed = runs.launch("resumed", 2, *map(str, [
        "--diloco.inner_steps", INNER, "--diloco.peers", f"127.0.0.1:{port}", "--runtime.timeout_s", TIMEOUT_S,
        "--optim.batch_size", ROWS, "--train.micro_bs", 1, "--ckpt.resume",
        f"{runs.tmp}/two_ranks_0_ckpt/step_{LOST_AT:08d}"]))
    code = resumed.wait_or_stop()
    if code != 0:
        peers.kill()
    peers_code = peers.wait(timeout=60)
    if code != 0 or peers_code != 0:
        print(runs.log("resumed")[-3000:])
        pytest.fail(f"the survivor's resume: exit code {code}, diloco_peers' {peers_code}")
    again = runs.records("resumed")
    want = {r["step"]: r["loss"] for r in records[0]}
    print(f"resumed from step {LOST_AT}: losses {[(r['step'], r['loss']) for r in again]}; first run's {want}")
    if [r["step"] for r in again] != list(range(LOST_AT + 1, STEPS + 1)) or \
            any(r["loss"] != want[r["step"]] for r in again):
        pytest.fail("the survivor's checkpoint did not resume exactly")
    if outer_state(f"{runs.tmp}/resumed_ckpt/step_{STEPS:08d}") != outer[0]:
        pytest.fail("the survivor's resume ended on other parameters")


def test_refusals(d):
    """A replica whose settings differ from the run's is refused, naming both; so is a replica whose
    diloco_peers does not answer; diloco_peers says when every replica is lost."""
    runs = d[0]
    port = free_port()
    peers = start([PEERS, "--port", port, "--replicas", 2, "--timeout_s", TIMEOUT_S], f"{runs.tmp}/refusals_peers.log")
    args = ["--diloco.inner_steps", str(INNER), "--diloco.peers", f"127.0.0.1:{port}", "--runtime.timeout_s",
            str(TIMEOUT_S), "--optim.batch_size", str(ROWS)]
    first = runs.launch("first", 1, *args)
    if not wait_for(lambda: "DiLoCo: replica 0 of the run" in runs.log("first"), 60, 0.02):
        pytest.fail(f"the first replica did not register:\n{runs.log('first')[-3000:]}")
    code = runs.launch("other_shape", 1, *args, "--data.seq_length", "16").wait()
    log = runs.log("other_shape")
    first.kill()
    peers.kill()
    print(log[-1500:])
    if code == 0 or "this replica cannot join the run there: its settings differ from the run's" not in log or \
            "seq 32" not in log or "seq 16" not in log:
        pytest.fail("a replica with another sequence length was not refused as it should be")
    code = runs.launch("no_peers", 1, *args[:2], "--diloco.peers", f"127.0.0.1:{free_port()}", *args[4:]).wait()
    log = runs.log("no_peers")
    print(log[-800:])
    if code == 0 or "nothing accepts connections there within 3 s (is diloco_peers running there?)" not in log:
        pytest.fail("an unreachable diloco_peers was not named")

    # Every replica lost: diloco_peers says so and exits 1.
    port = free_port()
    peers = start([PEERS, "--port", port, "--replicas", 1, "--timeout_s", TIMEOUT_S], f"{runs.tmp}/alone_peers.log")
    runs.launch("alone", 1, *args[:2], "--diloco.peers", f"127.0.0.1:{port}", *args[4:],
                env={"ZB_TEST_KILL_AFTER_STEP": 1})
    code = peers.wait(timeout=60)
    log = open(f"{runs.tmp}/alone_peers.log").read()
    print(log)
    if code != 1 or "every replica is lost (replica 0 lost before outer step 1" not in log:
        pytest.fail("diloco_peers did not say that every replica was lost")


def test_joiner(d):
    """Joiners (diloco.join) registered while 2 replicas start: let in at their first outer step
    (after step 2), taking the outer state from the member with the lowest id (its optimizer state
    too with join_state "peer"); from then on every replica's losses equal the reference's, and
    right after each outer step all of them hold the same outer copies and momenta. "fresh": one
    joiner; "peer": two at once."""
    runs, tokens, cfg, hf_config, init = d
    tmp = runs.tmp
    for join_state, joiners in (("fresh", 1), ("peer", 2)):
        name, n = f"join_{join_state}", joiners + 2
        ref = reference(cfg, hf_config, init, tokens, n, "muon", 0.7, 0.9, rows=ROWS,
                        joined={q: INNER for q in range(joiners)}, join_state=join_state)
        port = free_port()
        peers = start([PEERS, "--port", port, "--replicas", 2, "--timeout_s", SLACK_S], f"{tmp}/{name}_peers.log")
        args = ["--diloco.inner_steps", str(INNER), "--diloco.peers", f"127.0.0.1:{port}", "--runtime.timeout_s",
                str(SLACK_S), "--optim.batch_size", str(ROWS), "--ckpt.interval", str(INNER)]
        # The joiners first, so that they wait for the run's first outer step: replicas 0 (and 1).
        launches = []
        for r in range(n):
            join = ["--diloco.join", "true", "--diloco.join_state", join_state] if r < joiners else []
            launches.append(runs.launch(f"{name}_{r}", 1, *args, *join))
            if not wait_for(lambda: f"DiLoCo: replica {r} of the run" in runs.log(f"{name}_{r}"), 60, 0.02):
                pytest.fail(f"{name}: launch {r} did not register as replica {r}:\n{runs.log(f'{name}_{r}')[-3000:]}")
        codes = [p.wait() for p in launches]
        peers_code = peers.wait(timeout=60)
        peers_log = open(f"{tmp}/{name}_peers.log").read()
        took = [line for r in range(joiners) for line in runs.log(f"{name}_{r}").splitlines() if "bytes of state" in line]
        print(f"{name}: {took}\n{peers_log}")
        if codes != [0] * n or peers_code != 0:
            print(runs.log(f"{name}_0")[-3000:])
            pytest.fail(f"{name}: exit codes {codes}, diloco_peers' {peers_code}")
        # Fresh: the step counters (2 int64) and the outer copies and momentum, 8 bytes a parameter.
        params_count = sum(v.numel() for v in init.values())
        if join_state == "fresh" and f"took {16 + 8 * params_count:,} bytes of state" not in took[0]:
            pytest.fail(f"{name}: the joiner took other than the outer state's {16 + 8 * params_count:,} bytes")
        records = [runs.records(f"{name}_{r}") for r in range(n)]
        if any([r["step"] for r in records[q]] != list(range(INNER + 1, STEPS + 1)) or
               records[q][0]["membership"]["joined"] != list(range(joiners)) for q in range(joiners)) or \
                records[-1][INNER - 1]["membership"]["generation"] != 2:
            pytest.fail(f"{name}: the joiners did not join after step {INNER} as recorded")
        worst = max(abs(rec["loss"] - ref[0][rec["step"] - 1][q]) for q in range(n) for rec in records[q])
        print(f"{name}: losses {[[round(r['loss'], 5) for r in rec] for rec in records]}; largest difference from "
              f"the reference {worst:.2e}")
        if worst > 1e-5:
            pytest.fail(f"{name}: the replicas differ from the reference")
        for step in range(2 * INNER, STEPS + 1, INNER):  # the outer steps after the joiners' first
            outer = [outer_state(f"{tmp}/{name}_{r}_ckpt/step_{step:08d}") for r in range(n)]
            if any(o != outer[0] for o in outer):
                pytest.fail(f"{name}: the replicas' outer state differs after the outer step of step {step}")
        params = exported(f"{tmp}/{name}_0_ckpt/step_{STEPS:08d}")
        if max((params[k] - v).abs().max().item() for k, v in ref[2].items()) > 1e-4:
            pytest.fail(f"{name}: the final parameters differ from the reference's")


def test_exchange_that_keeps_failing(d):
    """2 replicas, the second failing after each attempt at outer step 1's exchange (an error that
    repeats, not a lost peer): the service stops the run at the fifth attempt, and every replica
    stops with its reason."""
    runs = d[0]
    port = free_port()
    peers = start([PEERS, "--port", port, "--replicas", 2, "--timeout_s", SLACK_S], f"{runs.tmp}/failing_peers.log")
    args = ["--diloco.inner_steps", str(INNER), "--diloco.peers", f"127.0.0.1:{port}", "--runtime.timeout_s",
            str(SLACK_S), "--optim.batch_size", str(ROWS), "--ckpt.path", ""]
    launches = []
    for r in range(2):  # one after the other, so that launch r registers as replica r
        launches.append(runs.launch(f"failing_{r}", 1, *args, env={"ZB_TEST_FAIL_EXCHANGE": 1} if r == 1 else None))
        if not wait_for(lambda: f"DiLoCo: replica {r} of the run" in runs.log(f"failing_{r}"), 60, 0.02):
            pytest.fail(f"launch {r} did not register as replica {r}:\n{runs.log(f'failing_{r}')[-3000:]}")
    codes = [p.wait() for p in launches]
    peers_code = peers.wait(timeout=60)
    peers_log = open(f"{runs.tmp}/failing_peers.log").read()
    print(peers_log)
    why = "outer step 1 failed 5 times in a row (last: the exchange failed on replica(s) 1): the run stops"
    if peers_code != 1 or why not in peers_log or peers_log.count("retried without the failed exchange") != 4:
        pytest.fail(f"diloco_peers (exit {peers_code}) did not stop the run after 5 attempts")
    for r in range(2):
        if codes[r] == 0 or why not in runs.log(f"failing_{r}"):
            pytest.fail(f"replica {r} (exit {codes[r]}) did not stop with the reason:\n{runs.log(f'failing_{r}')[-2000:]}")


def test_source_lost_after_its_exchange(d):
    """A joiner (0) waits while replicas 1-3 start; replica 1, the lowest-numbered member and so the
    joiner's source, dies after outer step 1's exchange, before its result is reported. The service
    commits the step with 2 and 3 and names replica 2 the source, and the members and the joiner all
    follow that: they hold the same outer state after each later outer step. Replica 3 dies the same
    way in the last outer step: 0 and 2 finish, and so does the service, without an error."""
    runs = d[0]
    tmp = runs.tmp
    port = free_port()
    peers = start([PEERS, "--port", port, "--replicas", 3, "--timeout_s", SLACK_S], f"{tmp}/source_peers.log")
    args = ["--diloco.inner_steps", str(INNER), "--diloco.peers", f"127.0.0.1:{port}", "--runtime.timeout_s",
            str(SLACK_S), "--optim.batch_size", str(ROWS), "--ckpt.interval", str(INNER)]
    launches = []
    for r in range(4):
        extra = ["--diloco.join", "true"] if r == 0 else []
        launches.append(runs.launch(f"source_{r}", 1, *args, *extra,
                                    env={1: {"ZB_TEST_KILL_AFTER_EXCHANGE": 1},
                                         3: {"ZB_TEST_KILL_AFTER_EXCHANGE": STEPS // INNER}}.get(r)))
        if not wait_for(lambda: f"DiLoCo: replica {r} of the run" in runs.log(f"source_{r}"), 60, 0.02):
            pytest.fail(f"launch {r} did not register as replica {r}:\n{runs.log(f'source_{r}')[-3000:]}")
    codes = [p.wait() for p in launches]
    peers_code = peers.wait(timeout=60)
    peers_log = open(f"{tmp}/source_peers.log").read()
    took = [line for line in runs.log("source_0").splitlines() if "bytes of state" in line]
    print(f"{took}\n{peers_log}")
    if codes[0] != 0 or codes[2] != 0 or codes[1] == 0 or codes[3] == 0 or peers_code != 0:
        print("\n".join(runs.log(f"source_{r}")[-2000:] for r in (0, 2)))
        pytest.fail(f"exit codes {codes}, diloco_peers' {peers_code}")
    if len(took) != 1 or "from replica 2 " not in took[0]:
        pytest.fail(f"the joiner did not take its state from replica 2: {took}")
    for step in range(2 * INNER, STEPS + 1, INNER):
        outer = [outer_state(f"{tmp}/source_{r}_ckpt/step_{step:08d}") for r in ((0, 2, 3) if step < STEPS else (0, 2))]
        if any(o != outer[0] for o in outer):
            pytest.fail(f"the replicas' outer state differs after the outer step of step {step}")


def test_rejoin_from_own_checkpoint(d):
    """2 replicas; the second stops after step 3 and is restarted from its own checkpoint of step 2 as
    a joiner (registered before the stopped process is killed): the first finishes outer step 2 alone,
    then lets it in; it keeps its checkpoint's optimizer state and takes the outer state. Both equal
    the reference in which replica 1 is lost and replica 2 joins after step 4 with replica 1's
    optimizer state of step 2, within 1e-5; they end on one model."""
    runs, tokens, cfg, hf_config, init = d
    tmp, timeout = runs.tmp, 4 * TIMEOUT_S  # room for the restart to register; the kill is seen at once
    ref = reference(cfg, hf_config, init, tokens, 3, "muon", 0.7, 0.9, rows=ROWS, lost={1: LOST_AT},
                    joined={2: LOST_AT}, resumed_from={2: (1, INNER)})
    port = free_port()
    peers = start([PEERS, "--port", port, "--replicas", 2, "--timeout_s", timeout], f"{tmp}/rejoin_peers.log")
    args = ["--diloco.inner_steps", str(INNER), "--diloco.peers", f"127.0.0.1:{port}", "--runtime.timeout_s",
            str(timeout), "--optim.batch_size", str(ROWS), "--ckpt.interval", str(INNER)]
    first = runs.launch("rejoin_0", 1, *args)
    wait_for(lambda: "DiLoCo: replica 0 of the run" in runs.log("rejoin_0"), 60, 0.02)
    second = runs.launch("rejoin_1", 1, *args, env={"ZB_TEST_STOP_AFTER_STEP": 3})
    if not wait_for(lambda: stopped(second.pid), 120, 0.02):
        pytest.fail(f"the second replica never stopped:\n{runs.log('rejoin_1')[-3000:]}")
    saved = f"{tmp}/rejoin_1_ckpt/step_{INNER:08d}"
    restarted = runs.launch("rejoin_2", 1, *args, "--diloco.join", "true", "--ckpt.resume", saved)
    if not wait_for(lambda: "DiLoCo: replica 2 of the run" in runs.log("rejoin_2"), 60, 0.02):
        pytest.fail(f"the restarted replica did not register:\n{runs.log('rejoin_2')[-3000:]}")
    second.kill()
    codes = [first.wait(), restarted.wait()]
    peers_code = peers.wait(timeout=60)
    peers_log = open(f"{tmp}/rejoin_peers.log").read()
    print(peers_log)
    if codes != [0, 0] or peers_code != 0:
        print(runs.log("rejoin_2")[-3000:])
        pytest.fail(f"exit codes {codes}, diloco_peers' {peers_code}")
    records = {0: runs.records("rejoin_0"), 2: runs.records("rejoin_2")}
    if [r["step"] for r in records[2]] != list(range(LOST_AT + 1, STEPS + 1)):
        pytest.fail(f"the restarted replica trained steps {[r['step'] for r in records[2]]}")
    worst = max(abs(rec["loss"] - ref[0][rec["step"] - 1][q]) for q in records for rec in records[q])
    print(f"losses {[[round(r['loss'], 5) for r in rec] for rec in records.values()]}; largest difference from the "
          f"reference {worst:.2e}")
    if worst > 1e-5:
        pytest.fail("the replicas differ from the reference")
    if outer_state(f"{tmp}/rejoin_0_ckpt/step_{STEPS:08d}") != outer_state(f"{tmp}/rejoin_2_ckpt/step_{STEPS:08d}"):
        pytest.fail("the replicas end on different models")


def test_replicas_of_different_shard_counts(d):
    """Replicas sharded over different numbers of ranks (a mixed generation, src/diloco/membership.h):
    replica 1 of one rank and replica 2 of two start; replica 0, of two ranks, joins after step 2 with
    replica 1's optimizer state ("peer"), resharded from one rank to two on the way. Every replica's
    losses equal the reference's within 1e-5, after each outer step all three hold the same outer
    copies and momenta bit for bit (each tensor's rows put together), and the final parameters equal
    the reference's within 1e-4. Then replicas 1 and 2 alone with uint8 pseudo-gradients (each
    owner's rows quantized apart): one model at the end, losses within 2e-2 of the reference's. And
    under TP 2, replicas of 2 and 4 ranks (shard counts 1 and 2, each TP slice's rows moved among the
    ranks holding that slice) as the reference within 1e-5."""
    runs, tokens, cfg, hf_config, init = d
    tmp = runs.tmp
    for compression, tp in (("none", 1), ("uint8", 1), ("none", 2)):
        name = f"mixed_{compression}" + (f"_tp{tp}" if tp > 1 else "")
        # replica launch -> its ranks; under TP 2 the shard counts are 1 and 2
        layouts = {0: 2, 1: 1, 2: 2} if tp == 1 else {1: 2, 2: 4}
        replicas = [0, 1, 2] if compression == "none" and tp == 1 else [1, 2]
        joined = {0: INNER} if replicas[0] == 0 else None
        ref = reference(cfg, hf_config, init, tokens, len(replicas), "muon", 0.7, 0.9, rows=ROWS, joined=joined,
                        join_state="peer")
        port = free_port()
        peers = start([PEERS, "--port", port, "--replicas", 2, "--timeout_s", SLACK_S], f"{tmp}/{name}_peers.log")
        args = ["--diloco.inner_steps", INNER, "--diloco.peers", f"127.0.0.1:{port}", "--runtime.timeout_s",
                SLACK_S, "--optim.batch_size", ROWS, "--ckpt.interval", INNER, "--diloco.compression", compression,
                "--parallel.tp", tp]
        launches = []
        for q, r in enumerate(replicas):
            join = ["--diloco.join", "true", "--diloco.join_state", "peer"] if joined and r in joined else []
            launches.append(runs.launch(f"{name}_{r}", layouts[r], *map(str, args), "--train.micro_bs",
                                        str(ROWS * tp // layouts[r]), *join))
            if not wait_for(lambda: f"DiLoCo: replica {q} of the run" in runs.log(f"{name}_{r}"), 60, 0.02):
                pytest.fail(f"{name}: launch {r} did not register as replica {q}:\n{runs.log(f'{name}_{r}')[-3000:]}")
        codes = [p.wait_or_stop() if layouts[r] > 1 else p.wait() for p, r in zip(launches, replicas)]
        peers_code = peers.wait(timeout=60)
        peers_log = open(f"{tmp}/{name}_peers.log").read()
        took = [line for line in runs.log(f"{name}_0").splitlines() if "bytes of state" in line] if joined else []
        print(f"{name}: {took}\n{peers_log}")
        if codes != [0] * len(replicas) or peers_code != 0:
            print("\n".join(runs.log(f"{name}_{r}")[-3000:] for r in replicas))
            pytest.fail(f"{name}: exit codes {codes}, diloco_peers' {peers_code}")
        first = [q for q, r in enumerate(replicas) if not (joined and r in joined)]
        if f"generation 1: replicas {','.join(map(str, first))} of 1,2 shards" not in peers_log:
            pytest.fail(f"{name}: diloco_peers' log does not give the replicas' shard counts")
        records = {r: runs.records(f"{name}_{r}") for r in replicas}
        if joined and ([r["step"] for r in records[0]] != list(range(INNER + 1, STEPS + 1)) or
                       records[0][0]["membership"]["joined"] != [0]):
            pytest.fail(f"{name}: the joiner did not join after step {INNER} as recorded")
        worst = max(abs(rec["loss"] - ref[0][rec["step"] - 1][q]) for q, r in enumerate(replicas) for rec in records[r])
        print(f"{name}: losses {[[round(r['loss'], 5) for r in rec] for rec in records.values()]}; largest "
              f"difference from the reference {worst:.2e}")
        if worst > (1e-5 if compression == "none" else 2e-2):
            pytest.fail(f"{name}: the replicas differ from the reference")
        for step in range(2 * INNER if joined else STEPS, STEPS + 1, INNER):
            outer = [outer_state(f"{tmp}/{name}_{r}_ckpt/step_{step:08d}") for r in replicas]
            if any(o != outer[0] for o in outer):
                pytest.fail(f"{name}: the replicas' outer state differs after the outer step of step {step}")
        if compression == "none":
            params = exported(f"{tmp}/{name}_2_ckpt/step_{STEPS:08d}")
            if max((params[k] - v).abs().max().item() for k, v in ref[2].items()) > 1e-4:
                pytest.fail(f"{name}: the final parameters differ from the reference's")
