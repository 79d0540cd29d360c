"""Load an exported model with transformers' LlamaForCausalLM and compare its logits with ours.

    python hf_check.py MODEL_DIR      (MODEL_DIR written by export_hf --check-logits)

Prints the largest absolute difference; exits 1 above 1e-4 (fp32 on both sides).
"""
import sys

import numpy as np
import torch
from transformers import LlamaForCausalLM

d = sys.argv[1]
model = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
tokens = torch.from_numpy(np.fromfile(f"{d}/check_tokens.bin", dtype=np.int64)).unsqueeze(0)
ours = torch.from_numpy(np.fromfile(f"{d}/check_logits.bin", dtype=np.float32)).view(1, tokens.shape[1], -1)
with torch.no_grad():
    theirs = model(tokens).logits
diff = (theirs - ours).abs().max().item()
print(f"transformers vs ours: logits {tuple(theirs.shape)}, largest |difference| {diff:.3e}")
sys.exit(0 if diff <= 1e-4 else 1)
