"""The experts' GEMMs on this CPU, two ways: one product per expert that has tokens (what
model/moe.cpp runs off the GPU) and ATen's grouped GEMM (torch._grouped_mm, what it runs on a GPU
in bf16), forward and backward of one SwiGLU expert layer, at the MoE shapes users train.

    .venv/bin/python scripts/perf/moe_experts_cpu.py [--threads 2] [--device cuda]

On a GPU (--device cuda, gpu_check's moe step) every shape runs in fp32 and bf16, timed between
device synchronisations; the grouped GEMM takes bf16 there.

Prints one line per shape and dtype (bf16 at the debug shape only): milliseconds per pass each way, and their ratio (above 1: the
per-expert products are faster), or why the grouped GEMM refused.
"""
import argparse
import time

import torch
import torch.nn.functional as F

# (name, tokens x top_k rows, experts, model dim, expert hidden dim)
SHAPES = [
    ("debug: 8 experts, top 2", 2 * 1024, 8, 256, 512),
    ("Mixtral-like, scaled down: 8 experts, top 2", 2 * 1024, 8, 1024, 3584),
    ("Moonlight-like, scaled down: 64 experts, top 6", 6 * 1024, 64, 1024, 704),
]


def layer(rows, counts, w1, w2, w3, grouped):
    offs = torch.cumsum(counts, 0).to(torch.int32)
    if grouped:
        mm = lambda x, w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    else:
        def mm(x, w):
            parts, start, experts = [], 0, w.unbind(0)  # unbind: one gradient for all of w, not one per expert
            for e, c in enumerate(counts.tolist()):
                if c:
                    parts.append(x[start:start + c] @ experts[e].t())
                start += c
            return torch.cat(parts)
    return mm(F.silu(mm(rows, w1)) * mm(rows, w3), w2)


def timed(fn, repeats=3, sync=lambda: None):
    fn()  # warm
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name, n, E, D, Fh in SHAPES:
        # Uneven loads, one expert without tokens: what a router gives.
        weights = torch.rand(E)
        weights[0] = 0
        counts = torch.multinomial(weights, n, replacement=True).bincount(minlength=E).to(device)
        # bf16 products are tens of times slower than fp32 on CPUs without bf16 instructions: the
        # debug shape alone.
        for dtype in (torch.float32, torch.bfloat16) if D <= 256 or gpu else (torch.float32,):
            rows = torch.randn(n, D, dtype=dtype, device=device, requires_grad=True)
            w1, w3 = (torch.randn(E, Fh, D, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
            w2 = torch.randn(E, D, Fh, dtype=dtype, device=device, requires_grad=True)
            probe = torch.randn(n, D, dtype=dtype, device=device)

            def run(grouped):
                (layer(rows, counts, w1, w2, w3, grouped) * probe).sum().backward()

            loop = timed(lambda: run(False), sync=sync)
            try:
                grouped = timed(lambda: run(True), sync=sync)
                print(f"{name}, {dtype}: per expert {loop:.1f} ms, grouped {grouped:.1f} ms, "
                      f"grouped / per expert {grouped / loop:.2f}")
            except RuntimeError as e:
                print(f"{name}, {dtype}: per expert {loop:.1f} ms, grouped refused: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
