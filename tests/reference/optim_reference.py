"""Reference trajectories from PyTorch's own optimizers, for the C++ tests.

    python optim_reference.py muon|muon_fsdp2|adamw OUTDIR

Writes OUTDIR/manifest.json and one raw little-endian float32 file per tensor: the initial
parameters, the gradient of every step, and the parameters (and Muon's momentum buffer) after
every step, computed by torch.optim.Muon / torch.optim.AdamW, or (muon_fsdp2) by ZeroBand's own
distributed Muon, the muon-fsdp2 package, on FSDP2 shards over 2 Gloo processes.
"""
import json
import os
import sys

import torch

STEPS = 3


def save(outdir, manifest, name, tensor):
    t = tensor.detach().to(torch.float32).contiguous().cpu()
    fname = name.replace("/", "_") + ".bin"
    t.numpy().tofile(os.path.join(outdir, fname))
    manifest[name] = {"shape": list(t.shape), "file": fname}


def muon_cases():
    """Square, wide and tall matrices under both update scales: (case, scale, initial value,
    the generator that then draws its gradients)."""
    seed = 0
    for scale in ("original", "match_rms_adamw"):
        for label, shape in {"square": (64, 64), "wide": (32, 96), "tall": (96, 32)}.items():
            seed += 1
            gen = torch.Generator().manual_seed(seed)
            yield f"{scale}/{label}", scale, torch.randn(shape, generator=gen) * 0.1, gen


def muon(outdir, manifest):
    # With weight decay.
    for case, scale, value, gen in muon_cases():
        p = torch.nn.Parameter(value)
        shape = value.shape
        save(outdir, manifest, f"{case}/param0", p)
        opt = torch.optim.Muon([p], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                               adjust_lr_fn=scale)
        for step in range(1, STEPS + 1):
            g = torch.randn(shape, generator=gen)
            p.grad = g.clone()
            opt.step()
            save(outdir, manifest, f"{case}/grad{step}", g)
            save(outdir, manifest, f"{case}/param{step}", p)
            save(outdir, manifest, f"{case}/momentum{step}", opt.state[p]["momentum_buffer"])


def muon_fsdp2(outdir, manifest):
    # The same cases as muon() through muon_fsdp2.Muon as ZeroBand uses it: every matrix sharded
    # by rows over 2 ranks (fully_shard), gathered to an owner for Newton-Schulz (bf16), scattered
    # back. rms_scale=False is torch's "original" scale, True its "match_rms_adamw".
    import torch.multiprocessing as mp
    # Newton-Schulz's loop eagerly (the package compiles it; inductor's fusion would change bf16
    # roundings only, and compiling costs about a minute here): the ranks read this at import.
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    # Forked: the ranks keep the torch this process imported (importing it again costs each 2.4 s
    # of CPU); nothing has run here yet, so no thread pool is copied half-made.
    mp.start_processes(_muon_fsdp2_rank, args=(2, outdir), nprocs=2, join=True, start_method="fork")
    manifest.update(json.load(open(os.path.join(outdir, "rank0_manifest.json"))))


def _muon_fsdp2_rank(rank, world, outdir):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from muon_fsdp2 import Muon as MuonFsdp2

    # Rendezvous through a file: no port that a test running alongside could take first.
    dist.init_process_group("gloo", init_method=f"file://{outdir}/rendezvous", rank=rank, world_size=world)
    manifest = {}
    for case, scale, value, gen in muon_cases():
        shape = value.shape
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(value)
        if rank == 0:
            save(outdir, manifest, f"{case}/param0", module.w)
        fully_shard(module)  # w becomes a DTensor sharded by rows over the 2 ranks
        w = module.w
        opt = MuonFsdp2([dict(params=[w], lr=0.02, momentum=0.95, weight_decay=0.1, use_muon=True,
                              rms_scale=scale == "match_rms_adamw", nesterov=True, ns_steps=5)])
        for step in range(1, STEPS + 1):
            g = torch.randn(shape, generator=gen)
            w.grad = distribute_tensor(g.clone(), w.device_mesh, [Shard(0)])
            opt.step()
            full = w.full_tensor()
            momentum = opt.state[w]["momentum_buffer"].full_tensor()
            if rank == 0:
                save(outdir, manifest, f"{case}/grad{step}", g)
                save(outdir, manifest, f"{case}/param{step}", full)
                save(outdir, manifest, f"{case}/momentum{step}", momentum)
    if rank == 0:
        with open(os.path.join(outdir, "rank0_manifest.json"), "w") as f:
            json.dump(manifest, f)
    # Both ranks done before either tears down: a rank that closes its Gloo pairs while the other
    # still has the last collective's traffic in flight aborts it (seen under a loaded suite).
    dist.barrier()
    dist.destroy_process_group()


def adamw(outdir, manifest):
    # ZeroBand's AdamW settings on a matrix, a vector and a small embedding; a changing lr.
    gen = torch.Generator().manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((17, 5), (33,), (8, 12))]
    for i, p in enumerate(params):
        save(outdir, manifest, f"p{i}/param0", p)
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.01)
    for step in range(1, STEPS + 2):
        multiplier = step / (STEPS + 1)  # as a warmup schedule would
        for group in opt.param_groups:
            group["lr"] = 0.01 * multiplier
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g.clone()
            save(outdir, manifest, f"p{i}/grad{step}", g)
        opt.step()
        for i, p in enumerate(params):
            save(outdir, manifest, f"p{i}/param{step}", p)
    manifest["steps"] = STEPS + 1


def main():
    which, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    manifest = {"steps": STEPS, "torch": torch.__version__}
    {"muon": muon, "muon_fsdp2": muon_fsdp2, "adamw": adamw}[which](outdir, manifest)
    with open(os.path.join(outdir, "manifest.json"), "w") as f:
        json.dump(manifest, f)


if __name__ == "__main__":
    main()
