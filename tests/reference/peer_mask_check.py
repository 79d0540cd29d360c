"""The benchmark peer's documents and document mask (scripts/perf/bench_peer.py) against a reference
that never builds a mask: attention run separately on each document (causal SDPA per slice, in
float64), the results put back in place.

    python peer_mask_check.py

Checks the fake rows have train_fsdp's layout (T + 1 tokens, documents of 1..T tokens each closed
by EOS, tokens in [3, 1024)), then both mask kernels of the peer: the dense boolean mask through
SDPA (what it trains with on CPU) and ZeroBand's BlockMask through flex attention, forward only
(PyTorch has no flex backward on CPU; on CUDA it trains with it). Exits 1 above 1e-10 (float64).
"""
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "perf"))
from bench_peer import EOS, FIRST_TOKEN, dense_document_mask, document_ids, fake_row, flex_document_mask

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # intended: eager
B, H, T, Dh, V = 6, 2, 200, 8, 32000  # T over 128: the BlockMask has more than one block per row
gen = torch.Generator().manual_seed(7)
rows = torch.from_numpy(np.stack([fake_row(7, i, T, V) for i in range(B)]))  # train_fsdp's rows 0..B-1, seed 7
assert rows.shape == (B, T + 1)
assert ((rows == EOS) | ((rows >= FIRST_TOKEN) & (rows < 1024))).all()
lengths = []  # of every document closed within its row, EOS included
for r in rows.tolist():
    ends = [i for i, t in enumerate(r) if t == EOS]
    lengths += [b - a for a, b in zip([-1] + ends, ends)]
assert lengths and all(2 <= n <= T + 1 for n in lengths), lengths
print(f"{len(lengths)} documents closed in {B} rows, {min(lengths)}..{max(lengths)} tokens with EOS")

tokens = rows[:, :-1]
docs = document_ids(tokens)
q, k, v = (torch.randn(B, H, T, Dh, generator=gen, dtype=torch.float64) for _ in range(3))

reference = torch.empty_like(q)
for b in range(B):
    start = 0
    for end in [i + 1 for i, t in enumerate(tokens[b].tolist()) if t == EOS] + [T]:
        if end > start:  # the document's own tokens, its EOS the last of them
            s = slice(start, end)
            reference[b, :, s] = F.scaled_dot_product_attention(q[b, :, s], k[b, :, s], v[b, :, s], is_causal=True)
        start = end

worst = 0.0
for name, out in [("sdpa dense mask", F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(docs))),
                  ("flex BlockMask", flex_attention(q, k, v, block_mask=flex_document_mask(docs)))]:
    err = (out - reference).abs().max().item()
    print(f"{name}: largest difference {err:.2e}")
    worst = max(worst, err)
sys.exit(0 if worst <= 1e-10 else 1)
