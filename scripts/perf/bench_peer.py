#!/usr/bin/env python3
"""The PyTorch peer of scripts/perf/bench.sh: the same model trained the way a PyTorch user would,
FSDP2's fully_shard on every block and on the root, Muon for the blocks' matrices and AdamW for
embedding, head and norms, on fake data. Muon is ZeroBand's own (--muon zeroband, the default:
the muon-fsdp2 package, which gathers each matrix's gradient shards to one owner rank, runs its
compiled Newton-Schulz there and scatters the result back) or torch.optim.Muon (--muon torch,
which orthogonalises DTensor shards, all-gathering inside every Newton-Schulz iteration).

A mixture of experts (model.num_experts) is `MixtureOfExperts` below: train_fsdp's routing, the
experts as 2-D Linears in a loop, the same initial draws, no expert parallelism.

With parallel.tp > 1 the model is 2-D as torchtitan builds it: a (dp_shard, tp) DeviceMesh whose
tp dimension groups consecutive ranks as train_fsdp's TP groups do, each block and the root
parallelize_module'd over tp (train_fsdp's Megatron layout with sequence parallelism, see
block_tp_plan) and then fully_shard'ed over dp_shard, the loss vocabulary-parallel (loss_parallel).
AdamW and torch.optim.Muon run on those 2-D DTensors; muon-fsdp2 0.3.0 cannot (why_not).

It reads the run that `train_fsdp --config X --print-config` resolves (shapes, batch, optimizer
settings), so both sides train the same thing, and writes the same JSON-lines metrics as
train_fsdp (rank 0). Its fake data are train_fsdp's random documents, row for row (the same
initial weights too, on CPU: the first step's loss matches ours); with model.attention =
"document" it masks them as ZeroBand does, flex attention with a BlockMask made per batch
(on CUDA; PyTorch cannot train flex attention on CPU, where it uses SDPA with the same mask as
dense booleans). A run the peer cannot train as asked (see why_not) leaves one record saying why,
which the report prints instead of numbers. Launched by torchrun, one process per rank:

  torchrun --nproc_per_node=2 scripts/perf/bench_peer.py --config-json run.json --steps 20 \
      --metrics-file peer.jsonl [--muon zeroband|torch] [--compile] [--device cpu|cuda] \
      [--mask-kernel auto|flex|sdpa]

Communication is measured by wrapping torch.distributed's collectives and the functional
collectives DTensor uses (TP's, Muon's matrices and the clipping norm go through DTensor): bytes with
train_fsdp's conventions, in all and under TP by group (comm_bytes_shard_group, comm_bytes_tp_group,
as train_fsdp's metrics), and host time spent waiting for them ("exposed"; on CPU FSDP2 issues its
collectives synchronously, so all of their time is exposed; on CUDA this is the host wait only).
"""
import argparse
import contextlib
import inspect
import json
import math
import os
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
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
        # Head counts from the projections' outputs: under TP they are this rank's heads.
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
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
    def __init__(self, m, hidden=None):
        super().__init__()
        hidden = hidden or m["ffn_hidden"]
        self.w1 = nn.Linear(m["dim"], hidden, bias=False)
        self.w2 = nn.Linear(hidden, m["dim"], bias=False)
        self.w3 = nn.Linear(m["dim"], hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtureOfExperts(nn.Module):
    """A mixture of experts as a PyTorch user writes one, with train_fsdp's routing (src/model/moe.h):
    an fp32 router (softmax or sigmoid scores, DeepSeek-V3's balancing bias choosing the top k but
    not weighting them, renormalised and scaled), each expert a SwiGLU of 2-D Linears (so that both
    Muons take them), a loop over the experts gathering their tokens and adding their weighted
    outputs back, and the shared experts beside. The counts of a forward with gradients move the
    bias after each step (`balance`), summed over the ranks as train_fsdp's."""

    def __init__(self, m):
        super().__init__()
        E, F_e = m["num_experts"], m["moe_inter_dim"]
        self.m = m
        self.gate = nn.Linear(m["dim"], E, bias=False)
        self.experts = nn.ModuleList(FeedForward(m, F_e) for _ in range(E))
        shared = m["num_shared_experts"] * F_e
        self.shared = FeedForward(m, shared) if shared else None
        self.register_buffer("expert_bias", torch.zeros(E), persistent=False)
        self.register_buffer("tokens", torch.zeros(E), persistent=False)

    def forward(self, x):
        m, D = self.m, x.shape[-1]
        t = x.reshape(-1, D)
        logits = t.float() @ self.gate.weight.float().t()
        scores = logits.softmax(-1) if m["score_func"] == "softmax" else logits.sigmoid()
        chosen = (scores.detach() + self.expert_bias).topk(m["top_k"], -1).indices
        weights = scores.gather(1, chosen)
        if m["route_norm"]:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * m["route_scale"]
        if torch.is_grad_enabled():
            self.tokens += torch.bincount(chosen.flatten(), minlength=len(self.experts)).float()
        out = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
        for e, expert in enumerate(self.experts):
            token, k = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(t[token]).float() * weights[token, k, None])
        out = out.to(x.dtype).view(x.shape)
        return out + self.shared(x) if self.shared is not None else out

    @torch.no_grad()
    def balance(self, coeff):
        dist.all_reduce(self.tokens)
        move = coeff * torch.sign(self.tokens.mean() - self.tokens)
        self.expert_bias += move - move.mean()
        self.tokens.zero_()


class Block(nn.Module):
    def __init__(self, m, layer):
        super().__init__()
        self.attention = Attention(m)
        moe = m.get("num_experts", 0) > 0 and layer >= m["n_dense_layers"]
        self.feed_forward = MixtureOfExperts(m) if moe else FeedForward(m)
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
        self.layers = nn.ModuleList(Block(m, i) for i in range(m["n_layers"]))
        self.norm = nn.RMSNorm(m["dim"], eps=m["norm_eps"])
        self.output = nn.Linear(m["dim"], m["vocab_size"], bias=False)
        self.register_buffer("freqs_cis", rope_table(m), persistent=False)

    def init_weights(self):
        # torchtitan's initialisation, as train_fsdp's.
        nn.init.normal_(self.tok_embeddings.weight)
        for i, b in enumerate(self.layers):
            depth_std = 0.02 / math.sqrt(2 * (i + 1))
            for w, std in [(b.attention.wq, 0.02), (b.attention.wk, 0.02), (b.attention.wv, 0.02),
                           (b.attention.wo, depth_std)]:
                nn.init.trunc_normal_(w.weight, std=std)
            ff = b.feed_forward
            if isinstance(ff, MixtureOfExperts):
                ff.expert_bias.zero_()  # buffers: to_empty left them uninitialised
                ff.tokens.zero_()
                # train_fsdp's draws: the gate, then each stack of the experts' matrices whole
                # ([E, out, in]), then the shared experts.
                nn.init.trunc_normal_(ff.gate.weight, std=depth_std)
                for name, std in (("w1", 0.02), ("w2", depth_std), ("w3", depth_std)):
                    ws = [getattr(e, name).weight for e in ff.experts]
                    stack = torch.empty(len(ws), *ws[0].shape, device=ws[0].device)
                    nn.init.trunc_normal_(stack, std=std)
                    with torch.no_grad():
                        for w, value in zip(ws, stack):
                            w.copy_(value)
                ff = ff.shared
            if ff is not None:
                for w, std in [(ff.w1, 0.02), (ff.w2, depth_std), (ff.w3, depth_std)]:
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


# --- tensor parallelism: train_fsdp's layout (src/model_parallel/tensor_parallel.h) in DTensor's plans ------
# Megatron's layout with sequence parallelism, as torchtitan applies it: the residual stream holds
# this rank's part of the sequence [B, T/tp, D]; the norms run on it, the sequence is all-gathered
# before the column-parallel products (this rank's heads and FFN columns) and the row-parallel
# ones' partial sums are reduce-scattered back onto it. The embedding is split over the vocabulary
# (its partial sums reduce-scattered onto the sequence), the head too, its logits left split for
# loss_parallel. tests/reference/tp_reference.py checks the same plans against the whole model.
def block_tp_plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    return {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        # The normed sequence parts are all-gathered once per module and stay a DTensor
        # (use_local_output=False): the products' input gradients, partial sums, add up as DTensors
        # and go back through that gather as one reduce-scatter. Local tensors there would
        # all-reduce each product's input gradient (3 in attention, 2 in the FFN) instead.
        # The RoPE table and the mask are plain tensors (or a BlockMask), whole on every rank.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None), use_local_output=False),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=False),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def root_tp_plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def layout_of(run, world):
    """(dp_shard, tp): train_fsdp's rank = dp_index * tp + tp_index, the TP group consecutive ranks,
    which init_device_mesh's row-major (dp_shard, tp) mesh reproduces."""
    par = run["parallel"]
    tp = par["tp"]
    dp_shard = par["dp_shard"] if par["dp_shard"] > 0 else world // (tp * par["dp_replicate"])
    return dp_shard, tp


# --- ZeroBand's fake documents and its document mask ------------------------------------------------
# train_fsdp's fake data (src/data/fake_data.cpp) reproduced draw for draw: row i of the endless
# dataset comes from std::mt19937_64 seeded by std::seed_seq{seed, i, 0x5eed}, through libstdc++'s
# std::uniform_int_distribution. Both sides train on the same tokens, so their losses compare
# step for step (the first step's to float rounding: the initial weights are drawn alike too).
EOS, FIRST_TOKEN = 1, 3
_M32 = 0xFFFFFFFF


def _seed_seq(values, n=624):
    """std::seed_seq(values).generate() of n 32-bit words (the standard's algorithm)."""
    v = [x & _M32 for x in values]
    s, b = len(v), [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p, q, m = (n - t) // 2, (n - t) // 2 + t, max(s + 1, n)
    mix = lambda x: x ^ (x >> 27)  # noqa: E731
    for k in range(m):
        r1 = 1664525 * mix(b[k % n] ^ b[(k + p) % n] ^ b[(k - 1) % n]) & _M32
        r2 = r1 + (s if k == 0 else k % n + v[k - 1] if k <= s else k % n) & _M32
        b[(k + p) % n] = (b[(k + p) % n] + r1) & _M32
        b[(k + q) % n] = (b[(k + q) % n] + r2) & _M32
        b[k % n] = r2
    for k in range(m, m + n):
        r3 = 1566083941 * mix((b[k % n] + b[(k + p) % n] + b[(k - 1) % n]) & _M32) & _M32
        r4 = (r3 - k % n) & _M32
        b[(k + p) % n] ^= r3
        b[(k + q) % n] ^= r4
        b[k % n] = r4
    return b


class _MT19937_64:
    """std::mt19937_64 seeded from a std::seed_seq, 312 outputs at a time."""
    N, M, A = 312, 156, np.uint64(0xB5026F5AA96619E9)
    UPPER, LOWER = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)

    def __init__(self, seed_values):
        w = _seed_seq(seed_values, 2 * self.N)
        self.x = np.array([w[2 * i] | w[2 * i + 1] << 32 for i in range(self.N)], dtype=np.uint64)
        self.buf, self.pos = np.empty(0, np.uint64), 0

    def _twist(self):
        x, n, m, one = self.x, self.N, self.M, np.uint64(1)
        def step(lo, hi, nxt, far):
            y = (x[lo:hi] & self.UPPER) | (nxt & self.LOWER)
            x[lo:hi] = far ^ (y >> one) ^ ((y & one) * self.A)
        step(0, n - m, x[1:n - m + 1], x[m:])          # x[i+1], x[i+m] still old
        step(n - m, n - 1, x[n - m + 1:], x[:m - 1])   # x[i+m-n] already new
        step(n - 1, n, x[:1], x[m - 1:m])
        y = x.copy()  # tempering
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        return y

    def draws(self, k):
        while len(self.buf) - self.pos < k:
            self.buf = np.concatenate([self.buf[self.pos:], self._twist()])
            self.pos = 0
        out = self.buf[self.pos:self.pos + k]
        self.pos += k
        return out

    def uniform(self, k, lo, hi):
        """k draws of std::uniform_int_distribution<int64_t>(lo, hi), libstdc++'s way for a 64-bit
        engine (Lemire's multiply-shift with rejection: the high 64 bits of draw x range)."""
        r = hi - lo + 1
        threshold = np.uint64((2**64 - r) % r)
        R, S32 = np.uint64(r), np.uint64(32)
        out = []
        while k:
            g = self.draws(k)
            rejected = np.flatnonzero(g * R < threshold)  # the low 64 bits (wraps)
            take = rejected[0] if rejected.size else k
            g = g[:take]
            high = ((g >> S32) * R + (((g & np.uint64(_M32)) * R) >> S32)) >> S32
            out.append(high.astype(np.int64) + lo)
            if rejected.size:  # the rejected draw is spent; what followed it is drawn again
                self.pos -= k - take - 1
            k -= take
        return np.concatenate(out) if out else np.empty(0, np.int64)


def fake_row(seed, index, T, V):
    """Sample `index`: T + 1 tokens, documents of length U[1, T] with tokens uniform in [3, 1024)
    (clipped to the vocabulary), each followed by EOS (none where the row cuts it off)."""
    rng = _MT19937_64([seed, index, 0x5EED])
    row = np.empty(T + 1, np.int64)
    n = 0
    while n < T + 1:
        remaining = int(rng.uniform(1, 1, T)[0])
        k = min(remaining, T + 1 - n)
        row[n:n + k] = rng.uniform(k, FIRST_TOKEN, min(1024, V) - 1)
        n += k
        if k == remaining and n < T + 1:
            row[n] = EOS
            n += 1
    return row


def rank_batches(run, data_rank, data_ranks, steps, accum):
    """This data-parallel rank's micro-batches [micro_bs, T + 1], in order, as train_fsdp's loader
    (src/data/loader.cpp) deals them: global batch s is samples [s*B, (s+1)*B), and data rank r
    reads the r-th of its data_ranks equal parts. Made before the steps, as train_fsdp's loader
    prepares them on a thread of its own."""
    B, micro, T, V, seed = (run["batch_size"], run["micro_bs"], run["seq_length"], run["model"]["vocab_size"],
                            run["runtime"]["seed"])
    per_rank = B // data_ranks
    out = []
    for s in range(steps):
        for i in range(accum):
            first = s * B + data_rank * per_rank + i * micro
            out.append(torch.from_numpy(np.stack([fake_row(seed, first + j, T, V) for j in range(micro)])))
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
    with warnings.catch_warnings():  # ZeroBand's _compile=True is deprecated in torch 2.11, still works
        warnings.filterwarnings("ignore", category=DeprecationWarning, message="_compile flag on create_block_mask")
        return create_block_mask(mask_mod, B, None, T, T, device=docs.device, BLOCK_SIZE=block,
                                 _compile=docs.is_cuda)


def compiled_flex_attention():
    # As ZeroBand: flex attention compiled on its own, outside the blocks' compilation, with
    # max-autotune unless PRIME_DEBUG is set. The blocks' compiler skips only the wrapper's frame
    # (recursive=False); the compiled kernel inside still runs. torch.compiler.disable applied to
    # the compiled function itself skips flex_attention's own code: it then runs unfused,
    # materialising every score (11x slower on an H200, 2026-11-25).
    mode = None if os.environ.get("PRIME_DEBUG") else "max-autotune-no-cudagraphs"
    kernel = torch.compile(flex_attention, dynamic=False, mode=mode)

    @torch.compiler.disable(recursive=False)
    def attend(q, k, v, block_mask, enable_gqa):
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    # The unfused fallback warns and goes on: here it stops the peer, which would be timed wrongly.
    # The warning comes once a process, and why_not's eager probe has had it: shown again.
    warnings.filterwarnings("error", message=".*flex_attention called without torch.compile")
    shown = getattr(sys.modules[flex_attention.__module__], "_WARNINGS_SHOWN", None)
    if shown is not None:
        shown.discard("flex_attention_performance")
    return attend


flex_attention_kernel = None  # compiled_flex_attention(), set by main() when the peer uses flex


# --- communication meter ---------------------------------------------------------------------------
# Bytes per rank as train_fsdp counts them (src/dist/comm_bytes.h, through comm_bytes.py): sent +
# received by this rank for the ring / chain algorithm of each collective, over the group it runs
# on (its size, this rank's place in it).
class CommMeter:
    """Wraps the collectives FSDP2 and DTensor call: bytes by kind (train_fsdp's convention, the
    functions above), in all and by named group of ranks, and host seconds spent waiting. `groups`
    names process groups as train_fsdp's metrics do ({group_name: "shard_group" or "tp_group"});
    the total counts every group, as train_fsdp's world communicator counts its subgroups'."""

    KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "gather", "scatter")

    def __init__(self, groups=None):
        self.names = dict(groups or {})
        self.bytes = dict.fromkeys(self.KINDS, 0)
        self.by_group = {name: dict.fromkeys(self.KINDS, 0) for name in self.names.values()}
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
        def nbytes(t):
            return t.numel() * t.element_size()

        def row_bytes(t):  # of dim 0, from the shape (a rank may send no rows)
            return math.prod(t.shape[1:]) * t.element_size()

        def process_group(group):
            # torch.distributed takes a ProcessGroup (None: the world); functional collectives
            # any of RANK_TYPES ((mesh, dim) from DTensor), resolved through the group's name.
            if group is None:
                return dist.distributed_c10d._get_default_group()
            if isinstance(group, dist.ProcessGroup):
                return group
            return dist.distributed_c10d._resolve_process_group(funcol._resolve_group_name(group))

        def counted(module, name, kind, size_of):
            fn = getattr(module, name)
            signature = inspect.signature(fn)

            def call(*a, **k):
                bound = signature.bind(*a, **k)
                bound.apply_defaults()  # positional or keyword alike
                pg = process_group(bound.arguments["group"])
                n = size_of(bound.arguments, pg.size(), pg.rank(), pg)
                self.bytes[kind] += n
                group = self.names.get(pg.group_name)
                if group:
                    self.by_group[group][kind] += n
                return fn(*a, **k)  # the waiting is timed in Work.wait / wait_tensor below
            setattr(module, name, call)

        def root_of(a, key, pg):  # the root in the group's numbering (`key` global, group_`key` not)
            return a["group_" + key] if a["group_" + key] is not None else dist.get_group_rank(pg, a[key])

        # torch.distributed: the output of an all-gather / input of a reduce-scatter is W parts.
        counted(dist, "all_gather_into_tensor", "all_gather", lambda a, W, r, pg: comm_bytes.counted("all_gather", W, nbytes(a["input_tensor"])))
        counted(dist, "reduce_scatter_tensor", "reduce_scatter", lambda a, W, r, pg: comm_bytes.counted("reduce_scatter", W, nbytes(a["output"])))
        counted(dist, "all_reduce", "all_reduce", lambda a, W, r, pg: comm_bytes.counted("all_reduce", W, nbytes(a["tensor"])))
        counted(dist, "broadcast", "broadcast", lambda a, W, r, pg: comm_bytes.counted(
            "broadcast", W, nbytes(a["tensor"]), r, root_of(a, "src", pg)))
        counted(dist, "all_to_all_single", "all_to_all", lambda a, W, r, pg: comm_bytes.all_to_all(
            W, r, row_bytes(a["input"]), a["input"].size(0), a["output"].size(0),
            a["input_split_sizes"], a["output_split_sizes"]))
        # ZeroBand's Muon (muon-fsdp2) gathers each matrix to its owner and scatters the result
        # back, through the names it imported from torch.distributed.
        try:
            import muon_fsdp2
            counted(muon_fsdp2, "gather", "gather", lambda a, W, r, pg: comm_bytes.counted(
                "gather", W, nbytes(a["tensor"]), r, root_of(a, "dst", pg)))
            counted(muon_fsdp2, "scatter", "scatter", lambda a, W, r, pg: comm_bytes.counted(
                "scatter", W, nbytes(a["tensor"]), r, root_of(a, "src", pg)))
        except ImportError:
            pass
        # Functional collectives (DTensor: TP's sequence gathers and reduce-scatters, loss_parallel's
        # all-reduces, Muon's matrices, the clipping norm): launched here, waited on in wait_tensor.
        # Their outputs are allocated inside: a reduce-scatter's is 1/W of the input.
        counted(funcol, "all_gather_tensor", "all_gather", lambda a, W, r, pg: comm_bytes.counted("all_gather", W, nbytes(a["self"])))
        counted(funcol, "reduce_scatter_tensor", "reduce_scatter", lambda a, W, r, pg: comm_bytes.counted("reduce_scatter", W, nbytes(a["self"]) // W))
        counted(funcol, "all_reduce", "all_reduce", lambda a, W, r, pg: comm_bytes.counted("all_reduce", W, nbytes(a["self"])))
        counted(funcol, "all_to_all_single", "all_to_all", lambda a, W, r, pg: comm_bytes.all_to_all(
            W, r, row_bytes(a["self"]), a["self"].size(0),
            sum(a["output_split_sizes"]) if a["output_split_sizes"] else a["self"].size(0),
            a["input_split_sizes"], a["output_split_sizes"]))
        # Host time blocked on a collective: torch.distributed's calls (synchronous ones too) end
        # in Work.wait from Python; functional collectives in wait_tensor.
        funcol.wait_tensor = self._timed(funcol.wait_tensor)
        work = dist.distributed_c10d.Work
        work.wait = self._timed(work.wait)

    def snapshot(self):
        return dict(self.bytes), {g: dict(b) for g, b in self.by_group.items()}, self.wait_seconds


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
    muon_run = run["hidden"]["type"] == "muon"
    dp_shard, tp = layout_of(run, world)
    if m.get("num_experts", 0) > 0:
        if m["num_expert_groups"] > 0 or m["aux_loss_coeff"] > 0:
            return "the peer's mixture routes without expert groups and without the sequence-wise auxiliary loss"
        if tp > 1:
            return "the peer's mixture has no tensor-parallel plan"
        if muon_run and muon == "zeroband" and world > 1 and (m["moe_inter_dim"] % world or m["num_experts"] % world):
            return (f"muon-fsdp2 needs equal shards: the experts' {m['moe_inter_dim']} rows or the gate's "
                    f"{m['num_experts']} not divisible by {world} ranks")
    if tp > 1:
        if run["parallel"]["dp_replicate"] > 1:
            return "TP with hybrid sharding (parallel.dp_replicate > 1): the peer builds a (dp_shard, tp) mesh only"
        if muon_run and muon == "zeroband":
            import muon_fsdp2
            return (f"muon-fsdp2 {muon_fsdp2.__version__} cannot orthogonalise TP x FSDP matrices: on a 2-D "
                    "(dp_shard, tp) mesh it takes TpFsdp2dWork, which raises NotImplementedError")
        # DTensor's plans give each rank whole heads (ours can share a key/value head between
        # ranks), equal parts of the FFN, the vocabulary and the sequence.
        split = {"n_heads": m["n_heads"], "n_kv_heads": m["n_kv_heads"], "ffn_hidden": m["ffn_hidden"],
                 "vocab_size": m["vocab_size"], "seq_length": run["seq_length"]}
        uneven = [f"{name} {n}" for name, n in split.items() if n % tp]
        if uneven:
            return f"DTensor's TP plans need {', '.join(uneven)} divisible by tp {tp}"
    elif muon == "zeroband" and muon_run and world > 1:
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
    """What train_fsdp's profiler summary counts (src/observe/profiler.cpp): the ATen operators
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
    dp_shard, tp = layout_of(run, W)
    mesh = dp_mesh = None  # without TP, FSDP2's default: one mesh dimension over the world
    groups = {}
    if tp > 1:
        # The same groups as train_fsdp's, named as its metrics name them: FSDP2 over the
        # dp_shard dimension, TP over the tp dimension.
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device, (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
        dp_mesh = mesh["dp_shard"]
        groups = {mesh.get_group("dp_shard").group_name: "shard_group", mesh.get_group("tp").group_name: "tp_group"}
    meter = CommMeter(groups)
    compute = torch.bfloat16 if run["resolved_compute_dtype"] == "bfloat16" else torch.float32

    torch.manual_seed(run["runtime"]["seed"])
    with torch.device("meta"):
        model = Llama(m)
    model.to_empty(device=device)
    model.freqs_cis = rope_table(m).to(device)  # to_empty left the buffer uninitialised
    model.init_weights()  # the whole model on every rank, from the same seed: TP and FSDP2 slice it
    if mesh is not None:
        # torchtitan's order: TP, then activation checkpointing and compilation, then FSDP2.
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(model, mesh["tp"], root_tp_plan())
        for block in model.layers:
            parallelize_module(block, mesh["tp"], block_tp_plan())
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if run["ac_ckpt"] and i % run["ac_ckpt"] == 0:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            block = checkpoint_wrapper(block)
            model.layers[i] = block
        if args.compile:
            block.compile()
        last = i == len(model.layers) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=run["reshard_after_forward"] and not last)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    optimizers = build_optimizers(model, run, args.muon)

    micro, T = run["micro_bs"], run["seq_length"]
    data_ranks = W // tp  # a TP group reads one data rank's rows
    accum = run["batch_size"] // (data_ranks * micro)
    assert accum * data_ranks * micro == run["batch_size"], "batch_size must divide by data ranks x micro_bs"
    tokens_per_step = run["batch_size"] * T
    batches = rank_batches(run, rank // tp, data_ranks, args.steps, accum)
    # Under TP the logits stay split over the vocabulary: loss_parallel's cross-entropy combines
    # the ranks' parts (forward and backward both inside it).
    loss_context = loss_parallel if tp > 1 else contextlib.nullcontext
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
        comm_before, groups_before, wait_before = meter.snapshot()
        marks = []  # (before forward, after forward, after backward) per micro-batch
        loss_sum = torch.zeros((), device=device)
        for i in range(accum):
            # train_fsdp's fake documents, the same rows. The mask is made here, as ZeroBand
            # makes it per batch.
            batch = batches[(step - 1) * accum + i].to(device, non_blocking=True)
            mask = None
            if kernel != "causal":
                docs = document_ids(batch[:, :-1])
                mask = flex_document_mask(docs) if kernel == "flex" else dense_document_mask(docs)
            model.set_requires_gradient_sync(i == accum - 1)
            t0 = phase_timer()
            with loss_context():
                loss = F.cross_entropy(model(batch[:, :-1], mask).flatten(0, 1), batch[:, 1:].flatten()) / accum
                t1 = phase_timer()
                loss.backward()
            marks.append((t0, t1, phase_timer()))
            loss_sum += loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()
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
        for block in model.layers:  # a mixture's balancing bias, as train_fsdp's (after the step)
            ff = getattr(block, "_checkpoint_wrapped_module", block).feed_forward
            if isinstance(ff, MixtureOfExperts) and m["load_balance_coeff"] > 0:
                ff.balance(m["load_balance_coeff"])
        t1 = phase_timer()
        dist.all_reduce(loss_sum)
        loss_value = loss_sum.item() / W  # the step's synchronisation (a TP group's ranks hold the same loss)
        fwd = sum(elapsed(a, b) for a, b, _ in marks)
        bwd = sum(elapsed(b, c) for _, b, c in marks)
        grad_norm = grad_norm.full_tensor().item() if hasattr(grad_norm, "full_tensor") else grad_norm.item()
        optimizer_seconds = elapsed(t0, t1)
        comm_after, groups_after, wait_after = meter.snapshot()
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
                # By group of ranks, under train_fsdp's names (comm_bytes_shard_group, _tp_group).
                **{f"comm_bytes_{g}": {k: b[k] - groups_before[g][k] for k in b} for g, b in groups_after.items()},
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
