"""DiLoCo runs of train_fsdp against an independent PyTorch reference (issue 29).

The tests (each a real run over loopback Gloo; ranks started with torchrun's variables, the others
stopped as torchrun would when one fails, conftest.Ranks):
  adamw_2x2    2 replicas of 2 ranks, AdamW inner steps
  muon_4x1     4 replicas of 1 rank, Muon inner steps (MuLoCo)
  one_replica  1 process, outer lr 1 and momentum 0: plain training (a run without DiLoCo)
  bytes        2 replicas of 2 ranks, pseudo-gradients as fp32, bf16 and uint8: the bytes across
               replicas as predicted, and losses close to fp32's
  streaming_2x2  2 replicas of 2 ranks, 2 fragments, each exchange applied a step after it starts
  resume       a rank killed inside an outer step and a kill inside a save: the last checkpoint (taken
               inside an outer period) resumes exactly, on the same layout and on another; streaming
               with an exchange in flight at the checkpoint resumes exactly; SIGTERM mid-run saves and
               the resume reaches the same end

The reference is written here, from PyTorch's own parts: transformers' LlamaForCausalLM (its logits
equal ours, tests/reference/hf_check.py) from the same initial weights, one copy per replica, each
trained on that replica's rows of the same batches by torch.optim.AdamW (and torch.optim.Muon for
the hidden matrices, its Newton-Schulz in fp32 as ours runs on the CPU) after
torch.nn.utils.clip_grad_norm_; every inner_steps steps and after the last, the mean over the
copies of (outer - inner) is the gradient of torch.optim.SGD(nesterov=True) on an outer copy, which
every copy then takes. Per step, each replica's loss must equal ours within 1e-5, and the final
parameters (our checkpoint's outer copy, exported) within 1e-5.
"""
import copy
import glob
import itertools
import json
import os
import re
import subprocess
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import DEBUG_CONFIG, EXPORT_HF, TRAIN_FSDP, Ranks, metrics, start, start_ranks

TRAIN = str(TRAIN_FSDP)
STEPS, INNER, SEQ, BATCH, VOCAB = 6, 2, 32, 8, 128


def common_args(tmp):
    """Every run's arguments: a tiny model on the data and initial weights under tmp."""
    return [
        "--config", str(DEBUG_CONFIG), "--runtime.device", "cpu",
        "--runtime.num_threads", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.vocab_size", str(VOCAB), "--model.multiple_of", "32", "--model.attention", "causal",
        "--data.fake", "false", "--data.shuffle", "false", "--data.dataset_name_or_paths", f"{tmp}/data",
        "--data.seq_length", str(SEQ), "--optim.batch_size", str(BATCH), "--train.micro_bs", "2",
        "--optim.total_steps", str(STEPS), "--optim.sched_type", "wsd-sqrt", "--optim.warmup_steps", "0",
        "--optim.stable_steps", str(STEPS), "--optim.optim.ns_dtype", "float32", "--ckpt.init_from", f"{tmp}/init",
        # AdamW's update g/(sqrt(v) + eps) turns fp32 summation differences in a gradient near eps into
        # visible ones (ZeroBand's eps 1e-10 with the embedding's lr 0.6 moves an element by up to 1e-4
        # in one step over them); a larger eps and a gentler embedding keep the comparison meaningful.
        "--optim.adam.eps", "1e-5", "--optim.adam.lr_embedding", "0.01",
    ]


class Runs:
    """The runs of one test, in a scratch folder holding their data, initial weights, metrics, logs
    and checkpoints."""

    def __init__(self, tmp):
        self.tmp, self.common = str(tmp), common_args(tmp)

    def launch(self, name, ranks, *extra, ckpt=None, env=None):
        """Starts one training run writing {name}.jsonl and {name}.log: one process, or several ranks
        started directly (rank r logging to {name}.log.r; Ranks.wait_or_stop stops them all when one
        fails, as torchrun does)."""
        tmp = self.tmp
        args = self.common + ["--logging.metrics_file", f"{tmp}/{name}.jsonl", "--ckpt.path",
                              ckpt or f"{tmp}/{name}_ckpt", *extra]
        if ranks == 1:
            return start([TRAIN, *args], f"{tmp}/{name}.log", env=env)
        return start_ranks(ranks, f"{tmp}/{name}.log", *args, env={**(env or {}), "LOCAL_WORLD_SIZE": ranks})

    def log(self, name):
        """A run's output: its log, or its ranks' logs one after the other."""
        paths = [f"{self.tmp}/{name}.log"] if os.path.exists(f"{self.tmp}/{name}.log") else \
            sorted(glob.glob(f"{self.tmp}/{name}.log.*"))
        return "".join(open(p).read() for p in paths)

    def records(self, name):
        return metrics(f"{self.tmp}/{name}.jsonl")

    def run(self, name, ranks, *extra, ckpt=None, final_step=STEPS):
        """One training run to the end; returns (its metrics records, its final parameters, its log)."""
        proc = self.launch(name, ranks, *extra, ckpt=ckpt)
        rc = proc.wait_or_stop() if isinstance(proc, Ranks) else proc.wait()
        log = self.log(name)
        if rc != 0:
            print(log[-4000:])
            pytest.fail(f"{name}: exit code {rc}")
        return self.records(name), exported(f"{ckpt or self.tmp + '/' + name + '_ckpt'}/step_{final_step:08d}"), log

    def resolved(self, *extra):
        """The run's settings as train_fsdp resolves them (the reference reads its numbers from here)."""
        out = subprocess.run([TRAIN, *self.common, *extra, "--print-config"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    def make_model(self, cfg):
        """The initial weights, as a Hugging Face directory."""
        from transformers import LlamaConfig, LlamaForCausalLM
        m = cfg["model"]
        hf_config = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["dim"], intermediate_size=m["ffn_hidden"],
                                num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                                num_key_value_heads=m["n_kv_heads"], head_dim=m["head_dim"],
                                rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"],
                                max_position_embeddings=2 * m["max_seq_len"], tie_word_embeddings=False,
                                attention_bias=False, mlp_bias=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM(hf_config).float()
        model.save_pretrained(f"{self.tmp}/init", safe_serialization=True)
        # Our reader computes the FFN width from ZeroBand's rounding, as our exports record it.
        path = f"{self.tmp}/init/config.json"
        c = json.load(open(path))
        c.update(zeroband_multiple_of=m["multiple_of"], zeroband_ffn_dim_multiplier=m["ffn_dim_multiplier"])
        json.dump(c, open(path, "w"))
        return hf_config, model.state_dict()

    def make_data(self):
        """A token shard of random tokens, enough for every step without repeating."""
        os.makedirs(f"{self.tmp}/data")
        tokens = torch.randint(0, VOCAB, (STEPS * BATCH * SEQ + 1,), generator=torch.Generator().manual_seed(1))
        header = np.zeros(256, dtype=np.int32)
        header[0], header[1], header[2] = 20240520, 1, tokens.numel()  # llm.c's format, uint16 tokens
        with open(f"{self.tmp}/data/train_000000.bin", "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.numpy().astype(np.uint16).tobytes())
        return tokens


@pytest.fixture
def d(work):
    """The runs, their data and initial weights made: (Runs, tokens, resolved config, HF config,
    initial state dict)."""
    runs = Runs(work)
    tokens = runs.make_data()
    cfg = runs.resolved()
    hf_config, init = runs.make_model(cfg)
    return runs, tokens, cfg, hf_config, init


def exported(ckpt_step_dir):
    """A checkpoint's model (under DiLoCo its outer copy) as export_hf writes it, by HF names."""
    from safetensors.torch import load_file
    out = ckpt_step_dir + "_hf"
    subprocess.run([EXPORT_HF, ckpt_step_dir, out], check=True, capture_output=True)
    return load_file(f"{out}/model.safetensors")


def muon_ns_fp32():
    """torch.optim.Muon with its Newton-Schulz iteration in fp32 (PyTorch's runs it in bf16)."""
    from torch.optim import _muon
    original = _muon._zeropower_via_newtonschulz

    def fp32(grad, *args, **kwargs):
        saved = torch.Tensor.bfloat16
        torch.Tensor.bfloat16 = torch.Tensor.float
        try:
            return original(grad, *args, **kwargs)
        finally:
            torch.Tensor.bfloat16 = saved
    _muon._zeropower_via_newtonschulz = fp32


def fragment_of(name, layers, fragments):
    """Streaming DiLoCo's fragments, as documented in src/diloco/diloco.h: runs of consecutive blocks
    (the first layers % fragments runs one longer), the embedding with the first, the rest the last."""
    if ".layers." in name:
        layer = int(name.split(".layers.")[1].split(".")[0])
        base, longer = divmod(layers, fragments)
        return layer // (base + 1) if layer < longer * (base + 1) else longer + (layer - longer * (base + 1)) // base
    return 0 if "embed_tokens" in name else fragments - 1


def reference(cfg, hf_config, init, tokens, replicas, inner_type, outer_lr, outer_momentum, fragments=1, delay=0,
              rows=None, lost=None, joined=None, join_state="fresh", resumed_from=None):
    """Per step each replica's loss (None once it has left) and the fragments that took an outer
    step; the final outer parameters.

    rows: each replica's rows a step (BATCH / replicas by default). Elastic replicas
    (test_elastic.py), numbered by their ids: lost = {replica: step}, the replica takes no part in
    the outer steps after that step and later; joined = {replica: step}, the replica joins after the
    outer step after that step, taking the outer parameters, and with join_state "peer" the
    optimizer state of the lowest-numbered replica that took part; resumed_from = {replica: (q, step)},
    a joiner restarted from replica q's checkpoint of that step keeps q's optimizer state of then. The data follow src/diloco/membership.h's rule: in a membership of m replicas that began
    after step t0 at stream row P, the k-th reads rows P + (t - t0 - 1)·m·rows + k·rows, [0, rows) in
    step t; the rule with every replica throughout is that of one launch's replicas."""
    from transformers import LlamaForCausalLM
    muon_ns_fp32()
    adam, hidden = cfg["adam"], cfg["hidden"]
    models, optimizers = [], []
    for _ in range(replicas):
        model = LlamaForCausalLM(hf_config).float()
        model.load_state_dict(init)
        groups = {"hidden": [], "embedding": [], "head": [], "norm": []}
        for name, p in model.named_parameters():
            role = ("embedding" if "embed_tokens" in name else "head" if name.startswith("lm_head")
                    else "norm" if p.dim() < 2 else "hidden")
            groups[role].append(p)
        betas = tuple(adam["betas"])
        adamw_groups = [dict(params=groups["embedding"], lr=adam["lr_embedding"], weight_decay=adam["wd"]),
                        dict(params=groups["head"], lr=adam["lr_head"], weight_decay=adam["wd"]),
                        dict(params=groups["norm"], lr=adam["lr_norm"], weight_decay=adam["wd"])]
        opts = []
        if inner_type == "muon":
            opts.append(torch.optim.Muon(groups["hidden"], lr=hidden["lr"], weight_decay=hidden["wd"],
                                         momentum=hidden["momentum"], nesterov=hidden["nesterov"],
                                         ns_steps=hidden["ns_steps"], adjust_lr_fn=hidden["update_scale"]))
        else:
            adamw_groups.append(dict(params=groups["hidden"], lr=hidden["lr"], weight_decay=hidden["wd"]))
        opts.append(torch.optim.AdamW(adamw_groups, betas=betas, eps=adam["eps"]))
        models.append(model)
        optimizers.append(opts)
    outer = [p.detach().clone() for p in models[0].parameters()]
    outer_params = [torch.nn.Parameter(t) for t in outer]
    outer_opt = torch.optim.SGD(outer_params, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    names = [name for name, _ in models[0].named_parameters()]
    layers = hf_config.num_hidden_layers
    members = [[i for i, n in enumerate(names) if fragment_of(n, layers, fragments) == f] for f in range(fragments)]
    in_flight = {}  # fragment -> (step to apply after, mean pseudo-gradient, each replica's inner at the start)

    def begin(f, step):
        apply_at = min(step + delay, STEPS)
        params = [list(m.parameters()) for m in models]
        mean = {i: torch.stack([outer_params[i].detach() - params[q][i].detach() for q in live]).mean(0)
                for i in members[f]}
        start = {(q, i): params[q][i].detach().clone() for q in live for i in members[f]}
        in_flight[f] = (apply_at, mean, start)

    def apply(f):
        _, mean, start = in_flight.pop(f)
        for i, p in enumerate(outer_params):  # SGD steps the parameters that have a gradient
            p.grad = mean[i] if i in mean else None
        outer_opt.step()
        for q in live:
            params = list(models[q].parameters())
            for i in members[f]:
                drift = params[i].detach() - start[(q, i)]  # the inner steps since the start
                params[i].copy_(outer_params[i].detach() + drift)

    losses, applied = [], []
    rows = rows or BATCH // replicas
    lost = lost or {}
    joined = joined or {}
    live = [q for q in range(replicas) if q not in joined]
    first_row, since = 0, 0  # the membership's first stream row and the step it began after
    resumed_from = resumed_from or {}
    snapshots = {}  # (replica, step) -> its optimizers' state after that step
    for step in range(1, STEPS + 1):
        step_losses = [None] * replicas
        for k, q in enumerate(live):
            model, opts = models[q], optimizers[q]
            # Replica q reads its slice of the step's rows of the stream; sample p is tokens
            # [p*SEQ, p*SEQ + SEQ + 1) (no shuffling).
            first = first_row + (step - since - 1) * len(live) * rows + k * rows
            batch = torch.stack([tokens[p * SEQ:p * SEQ + SEQ + 1] for p in range(first, first + rows)]).long()
            logits = model(batch[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
            for o in opts:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"])
            for o in opts:
                o.step()
            step_losses[q] = loss.item()
            if (q, step) in resumed_from.values():
                snapshots[(q, step)] = [copy.deepcopy(o.state_dict()) for o in opts]
        joining = [q for q, s in joined.items() if s == step]
        if (any(step >= s and q in live for q, s in lost.items()) or joining) and (step % INNER == 0 or step == STEPS):
            # A new membership from this outer step: the stream goes on where the old one's steps ended.
            first_row += (step - since) * len(live) * rows
            since = step
            live = [q for q in live if not (q in lost and step >= lost[q])]
        losses.append(step_losses)
        done = []
        with torch.no_grad():
            for f in range(fragments):  # due exchanges (every one after the last step), then new ones
                if f in in_flight and (in_flight[f][0] == step or step == STEPS):
                    apply(f)
                    done.append(f)
            for f in range(fragments):  # fragment f starts when (step + f * INNER / fragments) % INNER == 0
                if step == STEPS or (step + f * (INNER // fragments)) % INNER == 0:
                    begin(f, step)
                    if in_flight[f][0] == step:
                        apply(f)
                        done.append(f)
            for q in joining:  # after the outer step: the outer parameters, and maybe a peer's optimizer state
                for p, o in zip(models[q].parameters(), outer_params):
                    p.copy_(o.detach())
                if q in resumed_from:
                    for mine, saved in zip(optimizers[q], snapshots[resumed_from[q]]):
                        mine.load_state_dict(saved)
                elif join_state == "peer":
                    for mine, theirs in zip(optimizers[q], optimizers[live[0]]):
                        # A copy: load_state_dict keeps the very tensors it is given where their type fits.
                        mine.load_state_dict(copy.deepcopy(theirs.state_dict()))
            live = sorted(live + joining)
        applied.append(done)
    final = {name: p.detach() for (name, _), p in zip(models[0].named_parameters(), outer_params)}
    return losses, applied, final


def rank0_values(tensors):
    """Values of `tensors` on rank 0 of a shard group of 2: the first ceil(rows / 2) rows of each."""
    return sum((v.shape[0] + 1) // 2 * (int(np.prod(v.shape)) // v.shape[0]) for v in tensors.values())


def compare(name, records, params, ref_losses, ref_applied, ref_params, replicas):
    steps = [r["step"] for r in records]
    if steps != list(range(1, STEPS + 1)):
        pytest.fail(f"{name}: steps {steps}")
    worst_loss = 0.0
    for r, want in zip(records, ref_losses):
        got = r["replica_losses"] if replicas > 1 else [r["loss"]]
        worst_loss = max(worst_loss, max(abs(a - b) for a, b in zip(got, want)))
    worst_param = max((params[k] - v).abs().max().item() for k, v in ref_params.items())
    applied = [r["outer_step"]["fragments"] if "outer_step" in r else [] for r in records]
    print(f"{name}: losses {[round(r['loss'], 5) for r in records]}; largest difference from the reference: "
          f"loss {worst_loss:.2e}, parameter {worst_param:.2e}; fragments' outer steps by step {applied}")
    if applied != ref_applied:
        pytest.fail(f"{name}: outer steps {applied}, the reference's {ref_applied}")
    counts = [r["outer_step"]["outer_steps"] for r in records if r.get("outer_step", {}).get("fragments")]
    if counts != list(itertools.accumulate(len(a) for a in applied if a)):
        pytest.fail(f"{name}: outer step counts {counts}")
    # Losses within 1e-5 each step; parameters within 1e-4 (a hundredth of a step at these learning
    # rates: the few elements whose gradient is near AdamW's eps carry fp32 summation differences).
    if worst_loss > 1e-5 or worst_param > 1e-4:
        pytest.fail(f"{name}: differs from the reference (loss by more than 1e-5 or a parameter by more than 1e-4)")


def test_resume(d):
    """2 replicas of 2 ranks, checkpoints every 3 steps (step 3 is inside an outer period): a rank
    killed inside the second outer step, a kill inside a save; each resume continues exactly."""
    runs = d[0]
    tmp, launch, run, records = runs.tmp, runs.launch, runs.run, runs.records
    layout = ["--diloco.inner_steps", str(INNER), "--parallel.dp_replicate", "2", "--ckpt.interval", "3"]
    straight, straight_params, _ = run("straight", 4, *layout)

    # A rank stops at the start of the outer step after step 4 and, once the checkpoint of step 3 is
    # published, is killed there: the run stops (the others fail in the exchange, or are stopped
    # them), the checkpoint of step 3 is there and whole.
    ckpt = f"{tmp}/killed_ckpt"
    proc = launch("killed", 4, *layout, "--runtime.timeout_s", "20", ckpt=ckpt,
                  env={"ZB_TEST_HANG_IN_OUTER_STEP": "2"})
    pid = None
    for _ in range(1200):
        found = re.search(r"process (\d+) stops here", runs.log("killed"))
        if found and os.path.exists(f"{ckpt}/latest"):
            pid = int(found.group(1))
            break
        time.sleep(0.05)
    if pid is None:
        proc.kill()
        pytest.fail("the rank never stopped in outer step 2 with the checkpoint of step 3 published")
    os.kill(pid, 9)
    rc = proc.wait_or_stop()
    log = runs.log("killed")
    latest = open(f"{ckpt}/latest").read().strip()
    print(f"killed in outer step 2: exit code {rc}, latest checkpoint {latest}")
    if rc == 0 or latest != "step_00000003":
        print(log[-3000:])
        pytest.fail("a rank killed in the outer step: the run did not stop as it should")
    _, resumed_params, _ = run("resumed", 4, *layout, "--ckpt.resume", "latest", ckpt=ckpt)
    resumed = records("resumed")
    want = {r["step"]: r for r in straight}
    print("resumed from step 3:", [(r["step"], r["loss"], r.get("replica_losses")) for r in resumed])
    if [r["step"] for r in resumed] != [4, 5, 6]:
        pytest.fail(f"resumed steps {[r['step'] for r in resumed]}")
    for r in resumed:
        if r["replica_losses"] != want[r["step"]]["replica_losses"] or r.get("outer_step", {}).get("outer_steps") != \
                want[r["step"]].get("outer_step", {}).get("outer_steps"):
            pytest.fail(f"step {r['step']} after the resume differs from the run without one")
    if any(not torch.equal(resumed_params[k], straight_params[k]) for k in straight_params):
        pytest.fail("final parameters after the resume differ from the run without one")

    # The same checkpoint on another layout: 2 replicas of 1 rank (the same rows per replica).
    _, _, _ = run("resharded", 2, *layout, "--ckpt.resume", f"{ckpt}/step_00000003", ckpt=f"{tmp}/resharded_ckpt")
    diff = max(abs(a - b) for r in records("resharded") for a, b in zip(r["replica_losses"],
                                                                         want[r["step"]]["replica_losses"]))
    print(f"resumed on 2 replicas of 1 rank: largest loss difference {diff:.2e}")
    if diff > 1e-5:
        pytest.fail("the resume on another shard size strays")

    # More replicas than were saved: refused, naming why.
    rc = launch("more_replicas", 4, "--diloco.inner_steps", str(INNER), "--parallel.dp_replicate", "4",
                "--ckpt.resume", f"{ckpt}/step_00000003", ckpt=f"{tmp}/more_ckpt").wait_or_stop()
    log = runs.log("more_replicas")
    if rc == 0 or "it holds no replica_2/model/" not in log or "fewer replicas" not in log:
        print(log[-3000:])
        pytest.fail("a checkpoint of 2 replicas resumed on 4 without a clear error")

    # Streaming with an exchange in flight at the checkpoint (fragment 1 starts after step 3 and is
    # applied after step 4): the resume from step 3 continues exactly.
    stream = layout + ["--diloco.fragments", "2", "--diloco.fragment_delay", "1"]
    _, stream_params, _ = run("stream", 4, *stream)
    _, stream_resumed, _ = run("stream_resumed", 4, *stream, "--ckpt.resume", f"{tmp}/stream_ckpt/step_00000003")
    want_stream = {r["step"]: r for r in records("stream")}
    if any(r["replica_losses"] != want_stream[r["step"]]["replica_losses"] for r in records("stream_resumed")) or \
            any(not torch.equal(stream_resumed[k], stream_params[k]) for k in stream_params):
        pytest.fail("streaming: the resume with an exchange in flight differs from the run without one")
    print("streaming: resumed with an exchange in flight, steps 4-6 and the final parameters identical")

    # SIGTERM to every rank mid-run (as a scheduler's preemption): they finish the step (or the next), save and exit
    # 0; the resume reaches the uninterrupted run's end bit for bit.
    longer = ["--optim.total_steps", "20", "--optim.stable_steps", "20"]  # the data wrap around
    _, long_params, _ = run("long", 4, *layout, *longer, final_step=20)
    ckpt = f"{tmp}/term_ckpt"
    proc = launch("term", 4, *layout, *longer, ckpt=ckpt)
    for _ in range(600):
        if "step 5/20" in runs.log("term"):
            break
        time.sleep(0.05)
    subprocess.run(["pkill", "-TERM", "-f", f"^{TRAIN} .*{ckpt}"])  # every rank, as a scheduler does
    rc = proc.wait_or_stop()
    log = runs.log("term")
    stopped = [line for line in log.splitlines() if "stopped by a signal after step" in line]
    print(f"SIGTERM: exit code {rc}; {stopped[:1]}")
    if rc != 0 or len(stopped) != 4 or "checkpoint saved" not in stopped[0]:
        print(log[-3000:])
        pytest.fail("SIGTERM did not stop every rank with a checkpoint")
    _, term_params, _ = run("term_resumed", 4, *layout, *longer, "--ckpt.resume", "latest", ckpt=ckpt, final_step=20)
    if any(not torch.equal(term_params[k], long_params[k]) for k in long_params):
        pytest.fail("the resume after SIGTERM differs from the run without one")

    # Killed inside the save of step 6 (every writer paused after its data file): the checkpoint of
    # step 3 stays the latest, whole, and resumes to the same end.
    ckpt = f"{tmp}/save_killed_ckpt"
    proc = launch("save_killed", 4, *layout, ckpt=ckpt, env={"ZB_TEST_PAUSE_SAVE_AT_STEP": "6"})
    for _ in range(600):
        if runs.log("save_killed").count("writer paused inside the save of step 6") == 4:
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the writers never paused in the save of step 6")
    subprocess.run(["pkill", "-KILL", "-f", f"{ckpt}"])
    proc.wait()
    latest = open(f"{ckpt}/latest").read().strip()
    print(f"killed inside the save of step 6: latest checkpoint {latest}")
    if latest != "step_00000003":
        pytest.fail("a save killed midway replaced the last good checkpoint")
    _, again, _ = run("save_resumed", 4, *layout, "--ckpt.resume", "latest", ckpt=ckpt)
    if any(not torch.equal(again[k], straight_params[k]) for k in straight_params):
        pytest.fail("the resume after a killed save differs from the run without one")


DILOCO = ["--diloco.inner_steps", str(INNER)]


def against_reference(d, case, replicas, shard, inner):
    runs, tokens, cfg, hf_config, init = d
    records, params, log = runs.run(case, replicas * shard, *DILOCO, "--parallel.dp_replicate", str(replicas), *inner)
    if f"DiLoCo: {replicas} replica(s) of {shard} rank(s) train apart" not in log or "hybrid sharding:" in log:
        pytest.fail("the run does not describe DiLoCo (or describes a per-step all-reduce over the replicas)")
    cfg = runs.resolved(*inner)
    ref = reference(cfg, hf_config, init, tokens, replicas, cfg["hidden"]["type"], 0.7, 0.9)
    compare(case, records, params, *ref, replicas)


def test_adamw_2x2(d):
    against_reference(d, "adamw_2x2", 2, 2, ["--optim.optim.type", "adamw", "--optim.optim.lr", "0.01"])


def test_muon_4x1(d):
    against_reference(d, "muon_4x1", 4, 1, [])


def test_streaming_2x2(d):
    """Two fragments (a block each; the embedding with the first, the head with the second), an
    exchange every step, each applied one step after it starts; Muon inner steps."""
    runs, tokens, cfg, hf_config, init = d
    stream = ["--diloco.fragments", "2", "--diloco.fragment_delay", "1"]
    records, params, log = runs.run("streaming_2x2", 4, *DILOCO, *stream, "--parallel.dp_replicate", "2")
    if "DiLoCo streaming: 2 fragments of blocks, one exchange every 1 steps, each applied 1 step(s)" not in log:
        pytest.fail("the run does not describe streaming")
    ref = reference(cfg, hf_config, init, tokens, 2, "muon", 0.7, 0.9, fragments=2, delay=1)
    compare("streaming_2x2", records, params, *ref, 2)
    # Each exchange moves one fragment: the steps' bytes across replicas are a fragment's, not the
    # model's (the unfragmented run above moves both fragments at once).
    values = [rank0_values({n: v for n, v in init.items()
                            if fragment_of(n, hf_config.num_hidden_layers, 2) == f}) for f in range(2)]
    got = [r["outer_step"]["bytes_across_replicas"] for r in records]
    # Fragment f starts after the steps t with (t + f) % 2 == 0, both after the last; each start an
    # fp32 all-reduce of its values over 2 replicas (src/dist/comm_bytes.h: 4(W-1)/W bytes).
    want = [sum(8 * values[f] for f in range(2) if t == STEPS or (t + f) % 2 == 0) for t in range(1, STEPS + 1)]
    print(f"bytes across replicas by step: {got} (predicted {want}; the whole model's exchange: {8 * sum(values)})")
    if got != want:
        pytest.fail("streaming: bytes across replicas not as predicted")


def test_one_replica(d):
    runs = d[0]
    plain, plain_params, _ = runs.run("plain", 1)
    one, one_params, _ = runs.run("one", 1, *DILOCO, "--diloco.outer_lr", "1", "--diloco.outer_momentum", "0")
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(plain, one))
    # Relative to each tensor's largest value: AdamW moves the embedding to values of several units.
    param_diff = max(((plain_params[k] - one_params[k]).abs().max() / plain_params[k].abs().max()).item()
                     for k in plain_params)
    print(f"one replica, outer lr 1, momentum 0 vs plain training: losses {[r['loss'] for r in one]}, "
          f"largest difference: loss {loss_diff:.2e}, parameter {param_diff:.2e} (relative to the tensor's largest value)")
    # θ_outer - (θ_outer - θ_inner) in fp32 is θ_inner up to a rounding at θ_outer's scale where
    # θ_inner moved by more than half its value (Sterbenz): a few units in the last place, which
    # Muon's orthogonalisation spreads over the whole matrix by the next outer step.
    if loss_diff > 1e-6 or param_diff > 1e-5:
        pytest.fail("one replica with outer lr 1 and momentum 0 is not plain training")
    if any("outer_step" not in r for r in one if r["step"] % INNER == 0):
        pytest.fail("no outer step records")


def test_bytes(d):
    runs, init = d[0], d[4]
    results = {}
    for compression in ("none", "bf16", "uint8"):
        results[compression] = runs.run(compression, 4, *DILOCO, "--parallel.dp_replicate", "2",
                                        "--diloco.compression", compression)[0]
    # This rank's rows: half the model (2 ranks a replica); rank 0 writes the metrics.
    n = sum(int(np.prod(v.shape)) for v in init.values())
    shard_rows = rank0_values(init)
    chunk, buckets = 65536, 256
    predicted = {  # the convention of src/dist/comm_bytes.h, 2 replicas
        "none": 4 * (2 - 1) * (4 * shard_rows) // 2,                   # all-reduce of fp32
        "bf16": 2 * (2 - 1) * 2 * shard_rows,                          # all-gather of bf16
        "uint8": 2 * (2 - 1) * (shard_rows + (shard_rows + chunk - 1) // chunk * buckets * 4),  # codes, tables
    }
    for compression, records in results.items():
        outer = [r["outer_step"] for r in records if "outer_step" in r]
        got = {o["bytes_across_replicas"] for o in outer}
        per_step = sum(r["comm_bytes_replicate_group"]["all_gather"] + r["comm_bytes_replicate_group"]["all_reduce"]
                       for r in records)
        print(f"{compression}: {len(outer)} outer steps, {sorted(got)} bytes each across replicas (predicted "
              f"{predicted[compression]}; {n} parameters, {shard_rows} on rank 0), {per_step} in the steps' "
              f"records; final loss {records[-1]['loss']:.6f}")
        if got != {predicted[compression]} or per_step != len(outer) * predicted[compression]:
            pytest.fail(f"{compression}: bytes across replicas not as predicted")
    for compression in ("bf16", "uint8"):
        diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(results["none"], results[compression]))
        print(f"{compression} vs fp32: largest loss difference {diff:.2e}")
        if diff > 2e-2:
            pytest.fail(f"{compression} strays from fp32 pseudo-gradients")
