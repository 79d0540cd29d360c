#!/usr/bin/env python3
"""The GEMMs of a preset's block projections in bf16 and in FP8, timed alone: what FP8's tensor
cores give each projection before the casts and the rest of a step take their share.

For each projection (wq, wk, wv, wo, w1, w2, w3; shapes from `train_fsdp --print-config`) at a
micro-batch's tokens, the three GEMMs of a linear (y = x w^T, dx = g w, dw = g^T x), each as
the float8 recipe runs it (float8/float8.h): tensorwise (e4m3, the gradient e5m2, one scale a
tensor; the forward in cuBLASLt's fast accumulation) and rowwise (all e4m3, a scale a row); bf16
through torch.mm. The operands are cast before timing: the GEMMs alone. CUDA events, median of
--repeat runs after --warmup.

  scripts/perf/float8_gemms.py --train build/apps/train_fsdp --config configs/1B/H100.toml \\
      [configs/7B/H100.toml] [--out float8_gemms.json]

--device cpu runs the tensorwise GEMMs on the CPU (what ATen has there), small, for the tests.
"""
import argparse
import json
import statistics
import subprocess
import time

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def shapes(train, config):
    """(name, out, in) of a block's projections, and the micro-batch's tokens, from the run's config."""
    run = json.loads(subprocess.run([train, "--config", config, "--print-config"], check=True,
                                    stdout=subprocess.PIPE, text=True).stdout)
    m = run["model"]
    d, q, kv, f = m["dim"], m["n_heads"] * m["head_dim"], m["n_kv_heads"] * m["head_dim"], m["ffn_hidden"]
    projections = [("wq", q, d), ("wk", kv, d), ("wv", kv, d), ("wo", d, q), ("w1", f, d), ("w2", d, f), ("w3", f, d)]
    return projections, run["micro_bs"] * run["seq_length"]


def cast(t, dtype, rowwise):
    """t as FP8 with dynamic scales (per row where rowwise, powers of two), and the inverse scales."""
    fmax = torch.finfo(dtype).max
    amax = t.float().abs().amax(dim=1, keepdim=True) if rowwise else t.float().abs().amax()
    scale = fmax / amax.clamp(min=1e-12)
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal().float()


def gemm(a, b, rowwise, fast):
    """a [M, K] times b [N, K]^T, both (data, inverse scale): _scaled_mm's layouts (b column-major)."""
    (ad, ainv), (bd, binv) = a, b
    return torch._scaled_mm(ad, bd.t(), ainv, binv.t() if rowwise else binv, out_dtype=torch.bfloat16,
                            use_fast_accum=fast)


def timed(fn, device, warmup, repeat):
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def projection(name, n, k, m, device, warmup, repeat, recipes):
    """Seconds of the linear's three GEMMs under bf16 and each recipe."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    out = {"projection": name, "out": n, "in": k, "tokens": m,
           "flops": 3 * 2 * m * n * k}
    if device == "cuda":
        out["bf16"] = timed(lambda: (x @ w.t(), g @ w, g.t() @ x), device, warmup, repeat)
    if "tensorwise" in recipes:
        x8, w8, g8 = cast(x, E4M3, False), cast(w, E4M3, False), cast(g, E5M2, False)
        wt8 = (w8[0].t().contiguous(), w8[1])
        gt8, xt8 = (g8[0].t().contiguous(), g8[1]), (x8[0].t().contiguous(), x8[1])
        out["tensorwise"] = timed(lambda: (gemm(x8, w8, False, True), gemm(g8, wt8, False, False),
                                           gemm(gt8, xt8, False, False)), device, warmup, repeat)
    if "rowwise" in recipes:
        x8, w8 = cast(x, E4M3, True), cast(w, E4M3, True)
        g8, wt8 = cast(g, E4M3, True), cast(w.t().contiguous(), E4M3, True)
        gt8, xt8 = cast(g.t().contiguous(), E4M3, True), cast(x.t().contiguous(), E4M3, True)
        out["rowwise"] = timed(lambda: (gemm(x8, w8, True, True), gemm(g8, wt8, True, False),
                                        gemm(gt8, xt8, True, False)), device, warmup, repeat)
    for r in recipes:
        if "bf16" in out and r in out:
            out[f"{r}_speedup"] = out["bf16"] / out[r]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="build/apps/train_fsdp (reads the presets' shapes)")
    ap.add_argument("--config", nargs="+", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tokens", type=int, default=0, help="tokens a GEMM (default: the preset's micro-batch)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", help="JSON of every projection's seconds and speedups")
    args = ap.parse_args()
    recipes = ["tensorwise", "rowwise"] if args.device == "cuda" else ["tensorwise"]  # the CPU: tensorwise only
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "presets": {}}
    for config in args.config:
        projections, tokens = shapes(args.train, config)
        m = args.tokens or tokens
        rows = [projection(name, n, k, m, args.device, args.warmup, args.repeat, recipes) for name, n, k in projections]
        total = {key: sum(r[key] for r in rows) for key in ["bf16", *recipes] if all(key in r for r in rows)}
        report["presets"][config] = {"tokens": m, "projections": rows, "total_seconds": total}
        print(f"{config}: {m} tokens a GEMM")
        for r in rows:
            cells = "  ".join(f"{k} {r[k] * 1e3:8.3f} ms" for k in ["bf16", *recipes] if k in r)
            speed = "  ".join(f"x{r[f'{k}_speedup']:.2f}" for k in recipes if f"{k}_speedup" in r)
            print(f"  {r['projection']:3s} [{r['out']:5d} x {r['in']:5d}]  {cells}  {speed}")
        if "bf16" in total:
            print("  all seven: " + "  ".join(f"{k} x{total['bf16'] / total[k]:.2f}" for k in recipes if k in total))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
