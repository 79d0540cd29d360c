"""Reference trajectories from PyTorch's own optimizers, for the C++ tests.

    python optim_reference.py muon|adamw OUTDIR

Writes OUTDIR/manifest.json and one raw little-endian float32 file per tensor: the initial
parameters, the gradient of every step, and the parameters (and Muon's momentum buffer) after
every step, computed by torch.optim.Muon / torch.optim.AdamW.
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


def muon(outdir, manifest):
    # Square, wide and tall matrices, both update scales, with weight decay.
    shapes = {"square": (64, 64), "wide": (32, 96), "tall": (96, 32)}
    seed = 0
    for scale in ("original", "match_rms_adamw"):
        for label, shape in shapes.items():
            case = f"{scale}/{label}"
            seed += 1
            gen = torch.Generator().manual_seed(seed)
            p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.1)
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
    {"muon": muon, "adamw": adamw}[which](outdir, manifest)
    with open(os.path.join(outdir, "manifest.json"), "w") as f:
        json.dump(manifest, f)


if __name__ == "__main__":
    main()
