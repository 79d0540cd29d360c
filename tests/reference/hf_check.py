"""Load an exported model with transformers' LlamaForCausalLM and compare its logits with ours.

    python hf_check.py MODEL_DIR      (MODEL_DIR written by export_hf --check-logits)

Twice: attending causally over the whole sequence, and within documents, where transformers is
given the block-diagonal causal mask as a 4-D additive attention mask. Prints the largest absolute
difference of the logits and of the next-token losses; exits 1 above 1e-4 (fp32 on both sides).
"""
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

d = sys.argv[1]
model = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
tokens = torch.from_numpy(np.fromfile(f"{d}/check_tokens.bin", dtype=np.int64)).unsqueeze(0)
T = tokens.shape[1]


def ours(name):
    return torch.from_numpy(np.fromfile(f"{d}/{name}", dtype=np.float32)).view(1, T, -1)


def loss(logits):  # next-token cross-entropy, as training computes it
    return F.cross_entropy(logits[0, :-1], tokens[0, 1:]).item()


def block_diagonal_causal(cu):
    doc = torch.zeros(T, dtype=torch.long)
    for start in cu[1:-1]:
        doc[start:] += 1
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask.view(1, 1, T, T)


worst = 0.0
with torch.no_grad():
    cases = [("causal", "check_logits.bin", None)]
    if os.path.exists(f"{d}/check_documents.bin"):
        cu = np.fromfile(f"{d}/check_documents.bin", dtype=np.int32).tolist()
        cases.append((f"documents {cu}", "check_logits_documents.bin", block_diagonal_causal(cu)))
    for what, name, mask in cases:
        theirs = model(tokens, attention_mask=mask).logits
        diff = (theirs - ours(name)).abs().max().item()
        loss_diff = abs(loss(theirs) - loss(ours(name)))
        print(f"transformers vs ours, {what}: logits {tuple(theirs.shape)}, largest |difference| "
              f"{diff:.3e}; loss {loss(theirs):.6f} vs {loss(ours(name)):.6f}")
        worst = max(worst, diff, loss_diff)
    if len(cases) == 2:
        # The mask matters: the two ways differ after the first document.
        assert (ours("check_logits.bin") - ours("check_logits_documents.bin")).abs().max() > 1e-3
sys.exit(0 if worst <= 1e-4 else 1)
