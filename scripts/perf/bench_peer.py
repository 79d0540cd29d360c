#!/usr/bin/env python3
"""The PyTorch peer of scripts/perf/bench.sh: the same model trained the way a PyTorch user would,
FSDP2's fully_shard on every block and on the root, Muon for the blocks' matrices and AdamW for
embedding, head and norms, on fake data. Muon is ZeroBand's own (--muon zeroband, the default:
the muon-fsdp2 package, which gathers each matrix's gradient shards to one owner rank, runs its
compiled Newton-Schulz there and scatters the result back) or torch.optim.Muon (--muon torch,
which orthogonalises DTensor shards, all-gathering inside every Newton-Schulz iteration).

It reads the run that `train_fsdp --config X --print-config` resolves (shapes, batch, optimizer
settings), so both sides train the same thing, and writes the same JSON-lines metrics as
train_fsdp (rank 0). Its fake data are train_fsdp's random documents; with model.attention =
"document" it masks them as ZeroBand does, flex attention with a BlockMask made per batch
(on CUDA; PyTorch cannot train flex attention on CPU, where it uses SDPA with the same mask as
dense booleans). A run the peer cannot train as asked (see why_not) leaves one record saying why,
which the report prints instead of numbers. Launched by torchrun, one process per rank:

  torchrun --nproc_per_node=2 scripts/perf/bench_peer.py --config-json run.json --steps 20 \
      --metrics-file peer.jsonl [--muon zeroband|torch] [--compile] [--device cpu|cuda] \
      [--mask-kernel auto|flex|sdpa]

Communication is measured by wrapping torch.distributed's collectives and the functional
collectives DTensor uses (Muon's matrices and the clipping norm go through DTensor): bytes with
train_fsdp's conventions, and host time spent waiting for them ("exposed"; on CPU FSDP2 issues its
collectives synchronously, so all of their time is exposed; on CUDA this is the host wait only).
"""
import argparse
import inspect
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import comm_bytes  # the byte convention, from the C++ definition (same folder)


# --- the model: a Llama of torchtitan's layout (the names train_fsdp uses) -------------------------
class Attention(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = m["n_heads"], m["n_kv_heads"], m["head_dim"]
        self.wq = nn.Linear(m["dim"], self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(m["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(m["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, m["dim"], bias=False)

    def forward(self, x, freqs_cis, mask):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = rotate(q, freqs_cis), rotate(k, freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = self.n_kv_heads != self.n_heads
        if isinstance(mask, BlockMask):
            out = flex_attention_kernel(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:  # a dense boolean mask, or None: causal over whole rows
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


def rotate(x, freqs_cis):
    # Meta's RoPE: consecutive pairs as complex numbers, rotated in fp32.
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    T = x.shape[1]
    out = torch.view_as_real(pairs * freqs_cis[:T].view(1, T, 1, -1)).flatten(3)
    return out.type_as(x)


class FeedForward(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.w1 = nn.Linear(m["dim"], m["ffn_hidden"], bias=False)
        self.w2 = nn.Linear(m["ffn_hidden"], m["dim"], bias=False)
        self.w3 = nn.Linear(m["dim"], m["ffn_hidden"], bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.attention = Attention(m)
        self.feed_forward = FeedForward(m)
        self.attention_norm = nn.RMSNorm(m["dim"], eps=m["norm_eps"])
        self.ffn_norm = nn.RMSNorm(m["dim"], eps=m["norm_eps"])

    def forward(self, h, freqs_cis, mask):
        h = h + self.attention(self.attention_norm(h), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def rope_table(m):
    # e^(i * position * theta^(-2j/head_dim)), for twice the sequence length as train_fsdp.
    freqs = 1.0 / m["rope_theta"] ** (torch.arange(0, m["head_dim"], 2).float() / m["head_dim"])
    angles = torch.outer(torch.arange(2 * m["max_seq_len"]).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


class Llama(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.tok_embeddings = nn.Embedding(m["vocab_size"], m["dim"])
        self.layers = nn.ModuleList(Block(m) for _ in range(m["n_layers"]))
        self.norm = nn.RMSNorm(m["dim"], eps=m["norm_eps"])
        self.output = nn.Linear(m["dim"], m["vocab_size"], bias=False)
        self.register_buffer("freqs_cis", rope_table(m), persistent=False)

    def init_weights(self):
        # torchtitan's initialisation, as train_fsdp's.
        nn.init.normal_(self.tok_embeddings.weight)
        for i, b in enumerate(self.layers):
            depth_std = 0.02 / math.sqrt(2 * (i + 1))
            for w, std in [(b.attention.wq, 0.02), (b.attention.wk, 0.02), (b.attention.wv, 0.02),
                           (b.attention.wo, depth_std), (b.feed_forward.w1, 0.02),
                           (b.feed_forward.w2, depth_std), (b.feed_forward.w3, depth_std)]:
                nn.init.trunc_normal_(w.weight, std=std)
        for norm in [self.norm] + [n for b in self.layers for n in (b.attention_norm, b.ffn_norm)]:
            nn.init.ones_(norm.weight)
        std = self.output.weight.shape[1] ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens, mask=None):
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, self.freqs_cis, mask)
        return self.output(self.norm(h)).float()


# --- ZeroBand's fake documents and its document mask ------------------------------------------------
EOS, FIRST_TOKEN = 1, 3  # train_fsdp's fake data (src/data/fake_data.h): EOS closes each document


def fake_documents(rows, T, V, gen):
    """Rows of T + 1 tokens packed with documents of length U[1, T], tokens uniform in [3, 1024)
    (clipped to the vocabulary), each followed by EOS: train_fsdp's fake data, from another RNG."""
    out = torch.randint(FIRST_TOKEN, min(1024, V), (rows, T + 1), generator=gen)
    for r in range(rows):
        n = 0
        while True:
            n += int(torch.randint(1, T + 1, (), generator=gen)) + 1  # a document, then its EOS
            if n > T + 1:  # the document runs to the end of the row without its EOS
                break
            out[r, n - 1] = EOS
    return out


def document_ids(tokens):
    """Each position's document number within its row: EOS is the last token of its document."""
    closes = (tokens == EOS).int()
    return torch.cumsum(closes, dim=1) - closes


def dense_document_mask(docs):
    """(B, 1, T, T) booleans: causal and within one document."""
    T = docs.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return (docs[:, None, :, None] == docs[:, None, None, :]) & causal


def flex_document_mask(docs):
    """ZeroBand's BlockMask: the same rule as a mask_mod over 128-token blocks (T if shorter)."""
    def mask_mod(b, h, q, kv):
        return (q >= kv) & (docs[b, q] == docs[b, kv])
    B, T = docs.shape
    block = min(128, T)
    return create_block_mask(mask_mod, B, None, T, T, device=docs.device, BLOCK_SIZE=block,
                             _compile=docs.is_cuda)


def compiled_flex_attention():
    # As ZeroBand: flex attention compiled on its own, outside the blocks' compilation, with
    # max-autotune unless PRIME_DEBUG is set.
    mode = None if os.environ.get("PRIME_DEBUG") else "max-autotune-no-cudagraphs"
    return torch.compiler.disable(torch.compile(flex_attention, dynamic=False, mode=mode))


flex_attention_kernel = None  # compiled_flex_attention(), set by main() when the peer uses flex


# --- communication meter ---------------------------------------------------------------------------
# Bytes per rank as train_fsdp counts them (src/dist/comm_bytes.h, through comm_bytes.py): sent +
# received by this rank for the ring / chain algorithm of each collective. The group is the whole
# world (the peer's one mesh dimension spans every rank).
class CommMeter:
    """Wraps the collectives FSDP2 and DTensor call: bytes by kind (train_fsdp's convention, the
    functions above) and host seconds spent waiting."""

    def __init__(self, world, rank):
        self.W, self.rank = world, rank
        self.bytes = {k: 0 for k in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all",
                                     "gather", "scatter")}
        self.wait_seconds = 0.0
        self._wrap()

    def _timed(self, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.wait_seconds += time.perf_counter() - t
        return call

    def _wrap(self):
        W, rank = self.W, self.rank

        def nbytes(t):
            return t.numel() * t.element_size()

        def row_bytes(t):  # of dim 0, from the shape (a rank may send no rows)
            return math.prod(t.shape[1:]) * t.element_size()

        def counted(module, name, kind, size_of):
            fn = getattr(module, name)
            signature = inspect.signature(fn)

            def call(*a, **k):
                bound = signature.bind(*a, **k)
                bound.apply_defaults()
                self.bytes[kind] += size_of(bound.arguments)  # positional or keyword alike
                return fn(*a, **k)  # the waiting is timed in Work.wait / wait_tensor below
            setattr(module, name, call)

        def root_of(a):
            return a["src"] if a["src"] is not None else a["group_src"]

        # torch.distributed: the output of an all-gather / input of a reduce-scatter is W parts.
        counted(dist, "all_gather_into_tensor", "all_gather", lambda a: comm_bytes.counted("all_gather", W, nbytes(a["input_tensor"])))
        counted(dist, "reduce_scatter_tensor", "reduce_scatter", lambda a: comm_bytes.counted("reduce_scatter", W, nbytes(a["output"])))
        counted(dist, "all_reduce", "all_reduce", lambda a: comm_bytes.counted("all_reduce", W, nbytes(a["tensor"])))
        counted(dist, "broadcast", "broadcast", lambda a: comm_bytes.counted("broadcast", W, nbytes(a["tensor"]), rank, root_of(a)))
        counted(dist, "all_to_all_single", "all_to_all", lambda a: comm_bytes.all_to_all(
            W, rank, row_bytes(a["input"]), a["input"].size(0), a["output"].size(0),
            a["input_split_sizes"], a["output_split_sizes"]))
        # ZeroBand's Muon (muon-fsdp2) gathers each matrix to its owner and scatters the result
        # back, through the names it imported from torch.distributed.
        try:
            import muon_fsdp2
            counted(muon_fsdp2, "gather", "gather", lambda a: comm_bytes.counted(
                "gather", W, nbytes(a["tensor"]), rank, a["dst"] if a["dst"] is not None else a["group_dst"]))
            counted(muon_fsdp2, "scatter", "scatter", lambda a: comm_bytes.counted(
                "scatter", W, nbytes(a["tensor"]), rank, a["src"] if a["src"] is not None else a["group_src"]))
        except ImportError:
            pass
        # Functional collectives (DTensor): launched here, waited on in wait_tensor. Their outputs
        # are allocated inside: a reduce-scatter's is 1/W of the input (W divides it, or it fails).
        counted(funcol, "all_gather_tensor", "all_gather", lambda a: comm_bytes.counted("all_gather", W, nbytes(a["self"])))
        counted(funcol, "reduce_scatter_tensor", "reduce_scatter", lambda a: comm_bytes.counted("reduce_scatter", W, nbytes(a["self"]) // W))
        counted(funcol, "all_reduce", "all_reduce", lambda a: comm_bytes.counted("all_reduce", W, nbytes(a["self"])))
        counted(funcol, "all_to_all_single", "all_to_all", lambda a: comm_bytes.all_to_all(
            W, rank, row_bytes(a["self"]), a["self"].size(0),
            sum(a["output_split_sizes"]) if a["output_split_sizes"] else a["self"].size(0),
            a["input_split_sizes"], a["output_split_sizes"]))
        # Host time blocked on a collective: torch.distributed's calls (synchronous ones too) end
        # in Work.wait from Python; functional collectives in wait_tensor.
        funcol.wait_tensor = self._timed(funcol.wait_tensor)
        work = dist.distributed_c10d.Work
        work.wait = self._timed(work.wait)

    def snapshot(self):
        return dict(self.bytes), self.wait_seconds


# --- the run ---------------------------------------------------------------------------------------
def lr_multiplier(s, step):
    # train_fsdp's schedule (src/optim/lr_schedule.cpp), at the 1-based step.
    warm, stable, total = s["warmup_steps"], s["stable_steps"], s["total_steps"]
    if step < warm:
        return step / warm
    if s["type"] == "wsd-sqrt":
        return 1.0 if step < stable else max(0.0, 1 - math.sqrt((step - stable) / max(1, total - stable)))
    p = min(1.0, (step - warm) / max(1, total - warm))
    if s["type"] == "linear":
        return max(0.0, (total - step) / max(1, total - warm))
    return max(0.0, 0.5 * (1 + math.cos(math.pi * p)))


def vm_hwm_bytes():
    """Peak resident memory since the last reset through /proc/self/clear_refs."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def mask_kernel_of(run, device, choice):
    """How the peer attends: "causal" (whole rows), or with the document mask "flex" (ZeroBand's)
    or "sdpa" (a dense boolean mask)."""
    if run["attention"] == "causal":
        return "causal"
    if choice == "auto":
        return "flex" if device == "cuda" else "sdpa"
    return choice


def why_not(run, world, device, muon, kernel):
    """The reason the peer cannot train this run as asked, or None. Flex attention is probed (a
    later PyTorch that can train it is let through); muon-fsdp2's equal shards are its 0.3.0 code's
    assumption (its gather takes equal-size buffers)."""
    m = run["model"]
    if muon == "zeroband" and run["hidden"]["type"] == "muon" and world > 1:
        # muon-fsdp2 gathers the matrices' FSDP2 shards into equal-size buffers: every matrix's
        # rows must divide evenly between the ranks.
        rows = {"wq": m["n_heads"] * m["head_dim"], "wk/wv": m["n_kv_heads"] * m["head_dim"],
                "wo/w2": m["dim"], "w1/w3": m["ffn_hidden"]}
        uneven = [f"{name} ({n} rows)" for name, n in rows.items() if n % world]
        if uneven:
            return (f"muon-fsdp2 needs equal shards: {', '.join(uneven)} not divisible by {world} ranks")
    if kernel == "flex":
        q = torch.zeros(1, 1, 16, 16, device=device, requires_grad=True)
        try:
            flex_attention(q, q, q).sum().backward()
        except (NotImplementedError, RuntimeError) as e:
            return f"flex attention cannot train on {device} in PyTorch {torch.__version__}: {e}"
    return None


def build_optimizers(model, run, muon):
    h, a = run["hidden"], run["adam"]
    hidden, groups = [], {"embedding": [], "head": [], "norm": []}
    for name, p in model.named_parameters():
        if name.startswith("tok_embeddings."):
            groups["embedding"].append(p)
        elif name.startswith("output."):
            groups["head"].append(p)
        elif p.ndim < 2:
            groups["norm"].append(p)
        else:
            hidden.append(p)
    lrs = {"embedding": a["lr_embedding"], "head": a["lr_head"], "norm": a["lr_norm"]}
    adam_groups = [{"params": ps, "lr": lrs[k]} for k, ps in groups.items() if ps]
    if h["type"] != "muon":
        adam_groups.append({"params": hidden, "lr": h["lr"], "weight_decay": h["wd"]})
        hidden = []
    # fused=True: one kernel per group on CPU and GPU alike, as train_fsdp's AdamW.
    optimizers = [torch.optim.AdamW(adam_groups, betas=tuple(a["betas"]), eps=a["eps"], weight_decay=a["wd"],
                                    fused=True)]
    if hidden and muon == "zeroband":
        from muon_fsdp2 import Muon as ZeroBandMuon
        # Its rms_scale is the "match_rms_adamw" scale; without it, the "original" one.
        optimizers.append(ZeroBandMuon([dict(params=hidden, lr=h["lr"], momentum=h["momentum"], weight_decay=h["wd"],
                                             use_muon=True, rms_scale=h["update_scale"] == "match_rms_adamw",
                                             nesterov=h["nesterov"], ns_steps=h["ns_steps"])]))
    elif hidden:
        optimizers.append(torch.optim.Muon(hidden, lr=h["lr"], weight_decay=h["wd"], momentum=h["momentum"],
                                           nesterov=h["nesterov"], ns_steps=h["ns_steps"],
                                           adjust_lr_fn=h["update_scale"]))
    for opt in optimizers:
        for g in opt.param_groups:
            g["base_lr"] = g["lr"]
    return optimizers


def operator_counts(events):
    """What train_fsdp's profiler summary counts (src/train/profiler.cpp): the ATen operators
    dispatched on the CPU (nested ones too; autograd's nodes included, user scopes not) and the GPU
    kernels."""
    cpu = torch.autograd.DeviceType.CPU
    ops = sum(1 for e in events if e.scope == 0 and e.device_type == cpu and not e.is_user_annotation)
    kernels = sum(1 for e in events if e.device_type != cpu and not e.name.startswith(("Memcpy", "Memset")))
    return {"ops_dispatched": ops, "kernels_launched": kernels}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True, help="JSON from train_fsdp --print-config")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--metrics-file", required=True)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--compile", action="store_true", help="torch.compile every block")
    ap.add_argument("--muon", default="zeroband", choices=["zeroband", "torch"],
                    help="ZeroBand's muon-fsdp2 (default) or torch.optim.Muon")
    ap.add_argument("--mask-kernel", default="auto", choices=["auto", "flex", "sdpa"],
                    help="with model.attention = document: ZeroBand's flex attention (auto: on CUDA) "
                         "or SDPA with a dense boolean mask (auto: on CPU)")
    ap.add_argument("--num-threads", type=int, default=0)
    ap.add_argument("--profile-step", type=int, default=0,
                    help="record this step with torch.profiler: its record gets the operators dispatched "
                         "(counted as train_fsdp's profiler counts them) and the GPU kernels launched")
    args = ap.parse_args()
    with open(args.config_json) as f:
        run = json.load(f)
    m = run["model"]
    if run["hidden"]["type"] == "muon" and run["resolved_ns_dtype"] != "bfloat16":
        raise SystemExit("bench_peer: both peers' Muon orthogonalises in bfloat16 only; "
                         f"this run resolves optim.optim.ns_dtype to {run['resolved_ns_dtype']} "
                         "(scripts/perf/bench.sh passes --optim.optim.ns_dtype bfloat16 to every side)")

    # The device and dtype train_fsdp resolved for this run, unless --device overrides.
    device = args.device if args.device != "auto" else run["resolved_device"]
    if device == "cuda":  # first: the flex probe in why_not runs on this rank's GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kernel = mask_kernel_of(run, device, args.mask_kernel)
    reason = why_not(run, int(os.environ["WORLD_SIZE"]), device, args.muon, kernel)
    if reason:
        # The report shows the reason in place of this peer's numbers.
        if int(os.environ["RANK"]) == 0:
            with open(args.metrics_file, "w") as f:
                f.write(json.dumps({"unsupported": reason}) + "\n")
        print(f"bench_peer: not run: {reason}", flush=True)
        return
    if kernel == "flex":
        global flex_attention_kernel
        flex_attention_kernel = compiled_flex_attention()
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    meter = CommMeter(W, rank)
    compute = torch.bfloat16 if run["resolved_compute_dtype"] == "bfloat16" else torch.float32

    torch.manual_seed(run["runtime"]["seed"])
    with torch.device("meta"):
        model = Llama(m)
    model.to_empty(device=device)
    model.freqs_cis = rope_table(m).to(device)  # to_empty left the buffer uninitialised
    model.init_weights()
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if run["ac_ckpt"] and i % run["ac_ckpt"] == 0:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            block = checkpoint_wrapper(block)
            model.layers[i] = block
        if args.compile:
            block.compile()
        last = i == len(model.layers) - 1
        fully_shard(block, mp_policy=mp, reshard_after_forward=run["reshard_after_forward"] and not last)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    optimizers = build_optimizers(model, run, args.muon)

    micro, T, V = run["micro_bs"], run["seq_length"], m["vocab_size"]
    accum = run["batch_size"] // (W * micro)
    assert accum * W * micro == run["batch_size"], "batch_size must divide by world size x micro_bs"
    tokens_per_step = run["batch_size"] * T
    gen = torch.Generator().manual_seed(1000 + rank)
    cuda = device == "cuda"
    # Peak memory counts the steps, not set-up, as train_fsdp's (VmHWM reset on CPU).
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def phase_timer():
        # Host time on CPU; CUDA events on the GPU (no synchronisation inside the step).
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed(a, b):
        return a.elapsed_time(b) / 1e3 if cuda else b - a

    out = open(args.metrics_file, "w") if rank == 0 else None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        profiler = None
        if step == args.profile_step:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        comm_before, wait_before = meter.snapshot()
        marks = []  # (before forward, after forward, after backward) per micro-batch
        loss_sum = torch.zeros((), device=device)
        for i in range(accum):
            # Random documents as train_fsdp's fake data, from another RNG: the loss curves are
            # alike but not comparable. The mask is made here, as ZeroBand makes it per batch.
            batch = fake_documents(micro, T, V, gen).to(device, non_blocking=True)
            mask = None
            if kernel != "causal":
                docs = document_ids(batch[:, :-1])
                mask = flex_document_mask(docs) if kernel == "flex" else dense_document_mask(docs)
            model.set_requires_gradient_sync(i == accum - 1)
            t0 = phase_timer()
            loss = F.cross_entropy(model(batch[:, :-1], mask).flatten(0, 1), batch[:, 1:].flatten()) / accum
            t1 = phase_timer()
            loss.backward()
            marks.append((t0, t1, phase_timer()))
            loss_sum += loss.detach()
        t0 = phase_timer()
        # max_norm <= 0 means no clipping (train_fsdp still reports the norm).
        max_norm = run["max_norm"] if run["max_norm"] > 0 else math.inf
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        mult = lr_multiplier(run["schedule"], step)
        for opt in optimizers:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * mult
            opt.step()
            opt.zero_grad(set_to_none=True)
        t1 = phase_timer()
        dist.all_reduce(loss_sum)
        loss_value = loss_sum.item() / W  # the step's synchronisation
        fwd = sum(elapsed(a, b) for a, b, _ in marks)
        bwd = sum(elapsed(b, c) for _, b, c in marks)
        grad_norm = grad_norm.full_tensor().item() if hasattr(grad_norm, "full_tensor") else grad_norm.item()
        optimizer_seconds = elapsed(t0, t1)
        comm_after, wait_after = meter.snapshot()
        peak = torch.cuda.max_memory_allocated() if cuda else vm_hwm_bytes()
        counts = {}
        if profiler:
            profiler.__exit__(None, None, None)
            counts = operator_counts(profiler.events())
        if out:
            out.write(json.dumps({**counts,
                "step": step, "loss": loss_value, "grad_norm": grad_norm, "time": time.perf_counter() - start,
                "peak_memory_bytes": peak, "comm_wait_seconds": wait_after - wait_before,
                "forward_seconds": fwd, "backward_seconds": bwd, "optimizer_seconds": optimizer_seconds,
                "comm_bytes": {k: comm_after[k] - comm_before[k] for k in comm_after},
                "total_tokens": step * tokens_per_step, "attention_kernel": kernel,
            }) + "\n")
            out.flush()
            print(f"peer step {step}/{args.steps} | loss {loss_value:.4f} | {time.perf_counter() - start:.1f}s", flush=True)
    # Every rank past its last collective before Gloo's threads are torn down (without the
    # barrier a rank could abort in teardown while the other was still sending).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
