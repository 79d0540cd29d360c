"""Reference mixture-of-experts blocks from transformers, for the C++ tests (tests/test_moe.cpp).

    python moe_reference.py OUTDIR

Writes OUTDIR/manifest.json and one raw little-endian float32 file per tensor (as
optim_reference.py does). Cases, each a block of transformers' own on random weights and tokens,
fp32: "deepseek" (DeepseekV3MoE: sigmoid scores, a random e_score_correction_bias, 8 experts in
4 groups of which a token picks in 2, top 2, renormalised, routed_scaling_factor 2.5, one shared
expert), "qwen3_norm" and "qwen3_plain" (Qwen3MoeSparseMoeBlock: softmax, top 2, norm_topk_prob on
and off). Per case c: c/x [N, D], c/gate [E, D], c/bias [E] (zeros for Qwen3), c/gate_up
[E, 2F, D], c/down [E, D, F], for DeepSeek c/shared_gate, c/shared_up [S, D], c/shared_down
[D, S]; c/out, the block's output for x; c/grad_out, a random output gradient, and c/grad_x,
c/grad_gate, c/grad_gate_up, c/grad_down, the gradients of sum(out * grad_out).
"""
import json
import os
import sys

import torch

N, D, E, F = 40, 32, 8, 24


def save(outdir, manifest, name, tensor):
    t = tensor.detach().to(torch.float32).contiguous().cpu()
    fname = name.replace("/", "_") + ".bin"
    t.numpy().tofile(os.path.join(outdir, fname))
    manifest[name] = {"shape": list(t.shape), "file": fname}


SEEDS = {"deepseek": 1, "qwen3_norm": 2, "qwen3_plain": 3}


def run(outdir, manifest, case, block, router_bias=None, shared=None):
    gen = torch.Generator().manual_seed(SEEDS[case])
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if router_bias is not None:
            router_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    x = (torch.randn(1, N, D, generator=gen)).requires_grad_(True)
    out = block(x)
    grad_out = torch.randn(out.shape, generator=gen)
    (out * grad_out).sum().backward()
    save(outdir, manifest, f"{case}/x", x.reshape(N, D))
    save(outdir, manifest, f"{case}/gate", block.gate.weight)
    save(outdir, manifest, f"{case}/bias", router_bias if router_bias is not None else torch.zeros(E))
    save(outdir, manifest, f"{case}/gate_up", block.experts.gate_up_proj)
    save(outdir, manifest, f"{case}/down", block.experts.down_proj)
    if shared is not None:
        save(outdir, manifest, f"{case}/shared_gate", shared.gate_proj.weight)
        save(outdir, manifest, f"{case}/shared_up", shared.up_proj.weight)
        save(outdir, manifest, f"{case}/shared_down", shared.down_proj.weight)
    save(outdir, manifest, f"{case}/out", out.reshape(N, D))
    save(outdir, manifest, f"{case}/grad_out", grad_out.reshape(N, D))
    save(outdir, manifest, f"{case}/grad_x", x.grad.reshape(N, D))
    save(outdir, manifest, f"{case}/grad_gate", block.gate.weight.grad)
    save(outdir, manifest, f"{case}/grad_gate_up", block.experts.gate_up_proj.grad)
    save(outdir, manifest, f"{case}/grad_down", block.experts.down_proj.grad)


def main():
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    manifest = {"torch": torch.__version__}
    from transformers import DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    config = DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=2,
                              n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                              n_shared_experts=1, hidden_act="silu")
    block = DeepseekV3MoE(config).float()
    run(outdir, manifest, "deepseek", block, router_bias=block.gate.e_score_correction_bias, shared=block.shared_experts)
    for case, norm in (("qwen3_norm", True), ("qwen3_plain", False)):
        config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=2,
                                norm_topk_prob=norm, hidden_act="silu")
        run(outdir, manifest, case, Qwen3MoeSparseMoeBlock(config).float())
    with open(os.path.join(outdir, "manifest.json"), "w") as f:
        json.dump(manifest, f)


if __name__ == "__main__":
    main()
