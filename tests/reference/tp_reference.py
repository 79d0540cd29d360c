"""Reference tensor parallelism from PyTorch's own, for the C++ tests.

    python tp_reference.py TP OUTDIR        (TP = 2 or 4)

A small Llama, written here with ZeroBand's math and parameter names, is split over TP Gloo
processes on the CPU by torch.distributed.tensor.parallel (ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput, loss_parallel): Megatron's layout with sequence
parallelism, as torchtitan applies it and as model_parallel/tensor_parallel.h does. For each case (4
key/value heads; on 2 ranks also 2) it writes the whole weights, the tokens, the TP run's loss
and full logits, and every rank's local gradient, after checking them against the same model run
whole on one process (the script exits nonzero if they differ).

Writes OUTDIR/manifest.json and one raw little-endian float32 file per tensor (as
optim_reference.py does). Per case c: c/weight/<param>, c/tokens [B, T+1], c/loss [1],
c/logits [B, T, V], c/grad/<rank>/<param> (that rank's local shard). Plain entries besides:
"tp", "cases", "torch", "split/<param>" (the dimension the plan splits it on; -1: replicated)
and "c/args/<field>". (No entry but the tensors' may be a JSON object: the C++ reader takes every
object for a tensor.)
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

B, T = 2, 8
SEED_WEIGHTS, SEED_TOKENS = 7, 11


def model_args(kv_heads):
    # small_model() of tests/test_tensor_parallel.cpp; the rest are ModelArgs' defaults.
    a = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, vocab_size=64, multiple_of=16,
             ffn_dim_multiplier=0.0, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=16)
    # ModelArgs::ffn_hidden: 2/3 of 4*dim (integer division), times the multiplier if set,
    # rounded up to multiple_of.
    hidden = 2 * (4 * a["dim"]) // 3
    if a["ffn_dim_multiplier"] > 0:
        hidden = int(a["ffn_dim_multiplier"] * hidden)
    a["ffn_hidden"] = a["multiple_of"] * ((hidden + a["multiple_of"] - 1) // a["multiple_of"])
    return a


# ---- the model: ZeroBand's math (model/layers.cpp, llama.cpp, attention.cpp) ----

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x * rsqrt(mean(x^2, last dim) + eps) * weight: at::rms_norm, as ours calls it. DTensor
        # has a rule for it on a sequence-sharded input (the normalised dim is whole on every rank).
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rope_table(head_dim, positions, theta):
    # exp(j * pos * theta^(-2i/head_dim)), complex64 [positions, head_dim/2]; ZeroBand builds it
    # for twice max_seq_len.
    freqs = torch.pow(theta, torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim).reciprocal()
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), freqs)
    return torch.complex(torch.cos(angles), torch.sin(angles))


def apply_rope(x, cis):
    # Meta-style: adjacent pairs (2i, 2i+1) of x [B, T, H, Dh] are the complex x_2i + j x_2i+1.
    b, t, h, d = x.shape
    pairs = torch.view_as_complex(x.float().unflatten(-1, (d // 2, 2)))
    return torch.view_as_real(pairs * cis[:t].view(1, t, 1, d // 2)).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        D, H, KV = a["dim"], a["n_heads"], a["n_kv_heads"]
        self.head_dim = D // H
        self.wq = nn.Linear(D, H * self.head_dim, bias=False)
        self.wk = nn.Linear(D, KV * self.head_dim, bias=False)
        self.wv = nn.Linear(D, KV * self.head_dim, bias=False)
        self.wo = nn.Linear(H * self.head_dim, D, bias=False)

    def forward(self, x, cis):
        # Head counts from the projections' outputs, not the args: under ColwiseParallel these
        # are plain local tensors holding this rank's contiguous block of H/tp query and KV/tp
        # key/value heads.
        b, t, _ = x.shape
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        q, k = apply_rope(q, cis), apply_rope(k, cis)
        # GQA as SDPA's enable_gqa (which ours uses): query head h reads key/value head
        # h // (H / KV). Locally the same holds: rank r's query heads map to its own KV heads.
        rep = q.size(2) // k.size(2)
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)  # scale 1/sqrt(Dh)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, a):
        super().__init__()
        D, Fh = a["dim"], a["ffn_hidden"]
        self.w1 = nn.Linear(D, Fh, bias=False)
        self.w2 = nn.Linear(Fh, D, bias=False)
        self.w3 = nn.Linear(D, Fh, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = RMSNorm(a["dim"], a["norm_eps"])
        self.ffn_norm = RMSNorm(a["dim"], a["norm_eps"])

    def forward(self, x, cis):
        h = x + self.attention(self.attention_norm(x), cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a["vocab_size"], a["dim"])
        self.layers = nn.ModuleList(Block(a) for _ in range(a["n_layers"]))
        self.norm = RMSNorm(a["dim"], a["norm_eps"])
        self.output = nn.Linear(a["dim"], a["vocab_size"], bias=False)
        # A buffer, not a parameter: no plan touches it, and every rank has the whole table.
        self.register_buffer("cis", rope_table(a["dim"] // a["n_heads"], 2 * a["max_seq_len"],
                                               a["rope_theta"]), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cis)
        return self.output(self.norm(h))  # logits [B, T, V]


def whole_weights(model):
    # Drawn in the order of the model's parameters; matrices small enough that the softmax is not
    # saturated, norm weights off 1 so that the norms' gradients matter.
    torch.manual_seed(SEED_WEIGHTS)
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * torch.randn(p.shape)
        else:
            out[name] = 0.1 * torch.randn(p.shape)
    return out


def cross_entropy(logits, targets):
    # Mean next-token cross-entropy over all B*T tokens.
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---- the TP plan ----

def tp_plan(n_layers):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    plan = {
        # Vocabulary-parallel embedding: rank r's rows of the table give its words' vectors (zero
        # for the others), a partial sum that is reduce-scattered onto the sequence.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # The final norm's sequence shards are gathered; logits stay split over the vocabulary
        # for loss_parallel.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(n_layers):
        p = f"layers.{i}."
        plan.update({
            p + "attention_norm": SequenceParallel(),
            p + "ffn_norm": SequenceParallel(),
            # The normed sequence shards are all-gathered before the column-parallel products;
            # the RoPE table (the second input) is a plain tensor, left alone.
            p + "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None),
                                                use_local_output=True),
            p + "attention.wq": ColwiseParallel(),
            p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(),
            p + "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            p + "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),),
                                                   use_local_output=True),
            p + "feed_forward.w1": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            p + "feed_forward.w3": ColwiseParallel(),
        })
    return plan


def split_dim(name):
    # Where the plan above puts each parameter: Colwise Linear and Rowwise Embedding shard dim 0
    # of the weight, Rowwise Linear dim 1; the norms' weights are replicated.
    if name.endswith("norm.weight"):
        return -1
    if name.endswith(("wo.weight", "w2.weight")):
        return 1
    return 0


def run_rank(rank, world, outdir, cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    torch.set_num_threads(1)
    # Rendezvous through a file: no port that a test running alongside could take first.
    dist.init_process_group("gloo", init_method=f"file://{outdir}/rendezvous", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for case, kv in cases:
        a = model_args(kv)
        model = Llama(a)
        weights = whole_weights(model)
        torch.manual_seed(SEED_TOKENS)
        tokens = torch.randint(0, a["vocab_size"], (B, T + 1))
        inputs, targets = tokens[:, :T], tokens[:, 1:]
        # Identical on every rank by construction (the same seeds): SequenceParallel wraps its
        # weights with DTensor.from_local(run_check=False), trusting that they are.
        model.load_state_dict(weights, strict=True)
        parallelize_module(model, mesh, tp_plan(a["n_layers"]))

        logits = model(inputs)
        assert isinstance(logits, DTensor) and logits.placements[0].is_shard(2)
        # The loss from the vocabulary shards: each rank's log-sum-exp and target logits are
        # combined across ranks; no rank holds all the logits.
        with loss_parallel():
            loss = cross_entropy(logits, targets)
            loss.backward()
        grads, reshaped = {}, {}
        for name, p in model.named_parameters():
            # PyTorch leaves some gradients in other placements than their parameters': the norm
            # weights' (replicated, but applied to this rank's positions only) as Partial(sum),
            # per-rank sums that nothing reduces; the embedding's as Replicate, the whole table's
            # gradient on every rank. Redistributed to the parameter's placements as an optimizer
            # step on DTensors would: an all-reduce for the norms, a local slice for the table.
            g = p.grad
            if g.placements != p.placements:
                reshaped[name] = f"{g.placements} -> {p.placements}"
                g = g.redistribute(mesh, p.placements)
            grads[name] = g.to_local().clone()
        results[case] = dict(loss=loss.to_local().detach().clone(), logits=logits.full_tensor().detach(),
                             grads=grads, reshaped=reshaped)

    gathered = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()
    if rank == 0:
        torch.save(gathered, os.path.join(outdir, "tp_results.pt"))


# ---- the checks and the files ----

def save(outdir, manifest, name, tensor):
    t = tensor.detach().to(torch.float32).contiguous().cpu()
    fname = name.replace("/", "_") + ".bin"
    t.numpy().tofile(os.path.join(outdir, fname))
    manifest[name] = {"shape": list(t.shape), "file": fname}


class Mismatch(Exception):
    pass


def check(what, got, want, tol):
    # Relative to the largest magnitude of the wanted tensor.
    diff = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    if not diff <= tol * scale:
        raise Mismatch(f"{what}: differs by {diff:.3e}, more than {tol:g} of its largest magnitude {scale:.3e}")
    return diff / scale


def main():
    tp, outdir = int(sys.argv[1]), sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    # Both key/value head counts where TP splits them; with 2 on 4 ranks (each head shared by
    # two ranks, as ours supports) ColwiseParallel has no whole head to give each rank.
    cases = [(f"kv{kv}", kv) for kv in (4, 2) if kv % tp == 0]
    rendezvous = os.path.join(outdir, "rendezvous")
    if os.path.exists(rendezvous):
        os.remove(rendezvous)

    import torch.multiprocessing as mp
    # Forked: the ranks keep the torch this process imported (importing it again costs each 2.4 s
    # of CPU); nothing has run here yet, so no thread pool is copied half-made.
    mp.start_processes(run_rank, args=(tp, outdir, cases), nprocs=tp, join=True, start_method="fork")
    ranks = torch.load(os.path.join(outdir, "tp_results.pt"))
    os.remove(os.path.join(outdir, "tp_results.pt"))
    os.remove(rendezvous)

    manifest = {"tp": tp, "cases": [c for c, _ in cases], "torch": torch.__version__}
    worst = {"loss": 0.0, "logits": 0.0, "grad": 0.0}
    for case, kv in cases:
        a = model_args(kv)
        for field, value in a.items():
            manifest[f"{case}/args/{field}"] = value
        # The same model whole, on this process.
        torch.set_num_threads(1)
        model = Llama(a)
        weights = whole_weights(model)
        model.load_state_dict(weights)
        torch.manual_seed(SEED_TOKENS)
        tokens = torch.randint(0, a["vocab_size"], (B, T + 1))
        logits = model(tokens[:, :T])
        loss = cross_entropy(logits, tokens[:, 1:])
        loss.backward()

        for r, res in enumerate(ranks):
            got = res[case]
            worst["loss"] = max(worst["loss"], check(f"{case} rank {r} loss", got["loss"], loss.detach(), 1e-5))
            worst["logits"] = max(worst["logits"], check(f"{case} rank {r} logits", got["logits"], logits.detach(), 1e-5))
            for name, p in model.named_parameters():
                d = split_dim(name)
                want = p.grad if d < 0 else p.grad.chunk(tp, d)[r]
                g = got["grads"][name]
                if g.shape != want.shape:
                    raise Mismatch(f"{case} rank {r} {name}: local gradient {list(g.shape)}, want {list(want.shape)}")
                worst["grad"] = max(worst["grad"], check(f"{case} rank {r} grad {name}", g, want, 1e-5))

        for name, w in weights.items():
            save(outdir, manifest, f"{case}/weight/{name}", w)
            manifest[f"split/{name}"] = split_dim(name)
        save(outdir, manifest, f"{case}/tokens", tokens)
        save(outdir, manifest, f"{case}/loss", ranks[0][case]["loss"].reshape(1))
        save(outdir, manifest, f"{case}/logits", ranks[0][case]["logits"])
        for r, res in enumerate(ranks):
            for name, g in res[case]["grads"].items():
                save(outdir, manifest, f"{case}/grad/{r}/{name}", g)

    with open(os.path.join(outdir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    reshaped = {f"{c}/{n}": how for c, _ in cases for n, how in ranks[0][c]["reshaped"].items()}
    print(f"tp {tp}, cases {manifest['cases']}: TP equals the whole model; largest differences, relative "
          f"to the largest magnitude: loss {worst['loss']:.2e}, logits {worst['logits']:.2e}, "
          f"gradients {worst['grad']:.2e}")
    print("gradients PyTorch left in other placements than their parameters' (redistributed):")
    for name, how in reshaped.items():
        print(f"  {name}: {how}")


if __name__ == "__main__":
    try:
        main()
    except Mismatch as e:
        sys.exit(f"tp_reference: tensor parallel run differs from the whole model: {e}")
