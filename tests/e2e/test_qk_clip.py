"""QK-clip (MuonClip; optim.optim.qk_clip_threshold) trained by train_fsdp against an independent
PyTorch reference (issue 63).

The reference is transformers' LlamaForCausalLM with eager attention (GQA: 4 query heads on 2 key
heads), from the same initial weights, trained on the same batches by torch.optim: Muon for the
hidden matrices (Newton-Schulz in fp32, as ours on the CPU) and AdamW for the embedding, the head
and the norms, after torch.nn.utils.clip_grad_norm_. Its attention records each head's largest
pre-softmax logit (the scaled scores plus the causal mask, before the softmax) over the step's
batch; after both optimizers QK-clip, written here from Kimi K2's rule, scales each head above the
threshold τ: with γ = τ / S, its q_proj rows by γ^α and its key head's k_proj rows by the smallest
γ^(1-α) of that key head's query heads. τ is set below every block's largest logit at the first
step, so that the clip fires.

Runs, each a real process: one (1 process) and tp2 (2 ranks, each with its 2 heads). Per step the
loss and each block's logged largest logit must equal the reference's within 1e-5, the heads
clipped must be the same, and the final parameters (exported to Llama's files by export_hf)
within 1e-4.
"""
import subprocess

import torch
import torch.nn.functional as F

from conftest import DEBUG_CONFIG, TRAIN_FSDP, metrics, run_ranks, start
from test_diloco import exported, muon_ns_fp32
from test_moe import make_data as moe_make_data

STEPS, SEQ, BATCH, VOCAB, LAYERS, HEADS, KV_HEADS, DIM = 20, 32, 8, 128, 2, 4, 2, 64
ALPHA = 0.3


def args(tmp, tau):
    return [
        "--config", str(DEBUG_CONFIG), "--runtime.device", "cpu", "--runtime.num_threads", "1",
        "--model.dim", str(DIM), "--model.n_layers", str(LAYERS), "--model.n_heads", str(HEADS),
        "--model.n_kv_heads", str(KV_HEADS), "--model.vocab_size", str(VOCAB), "--model.attention", "causal",
        "--data.fake", "false", "--data.shuffle", "false", "--data.dataset_name_or_paths", f"{tmp}/data",
        "--data.seq_length", str(SEQ), "--optim.batch_size", str(BATCH), "--train.micro_bs", "2",
        "--optim.total_steps", str(STEPS), "--optim.sched_type", "wsd-sqrt", "--optim.warmup_steps", "0",
        "--optim.stable_steps", str(STEPS), "--optim.optim.ns_dtype", "float32", "--ckpt.init_from", f"{tmp}/init",
        # As in test_moe.py: a larger AdamW eps and a gentler embedding keep fp32 summation
        # differences from being amplified.
        "--optim.adam.eps", "1e-5", "--optim.adam.lr_embedding", "0.01", "--ckpt.interval", str(STEPS),
        "--optim.optim.qk_clip_threshold", repr(tau), "--optim.optim.qk_clip_alpha", str(ALPHA),
    ]


def make_data(tmp):
    return moe_make_data(tmp, STEPS, BATCH, SEQ, VOCAB, seed=5)


def make_model(tmp):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=256, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=2 * SEQ, tie_word_embeddings=False,
                         attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # larger query and key weights: logits far enough above the noise to clip
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(f"{tmp}/init", safe_serialization=True)
    return config, {k: v.clone() for k, v in model.state_dict().items()}


def reference(cfg, config, init, tokens, tau):
    """Per step the loss, each block's largest logit and the heads clipped; the final parameters."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama
    muon_ns_fp32()
    watched = {}  # layer -> each head's largest logit over the step

    def eager_watched(module, query, key, value, attention_mask, scaling, **kwargs):
        scores = query @ modeling_llama.repeat_kv(key, module.num_key_value_groups).transpose(2, 3) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, :, : key.shape[-2]]
        largest = scores.detach().amax(dim=(0, 2, 3))
        seen = watched.get(module.layer_idx)
        watched[module.layer_idx] = largest if seen is None else torch.maximum(seen, largest)
        return original(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    original = modeling_llama.eager_attention_forward
    modeling_llama.eager_attention_forward = eager_watched
    try:
        model = LlamaForCausalLM(config).float()
        model.load_state_dict(init)
        adam, hidden = cfg["adam"], cfg["hidden"]
        groups = {"hidden": [], "embedding": [], "head": [], "norm": []}
        for name, p in model.named_parameters():
            role = ("embedding" if "embed_tokens" in name else "head" if name.startswith("lm_head")
                    else "norm" if p.dim() < 2 else "hidden")
            groups[role].append(p)
        muon = torch.optim.Muon(groups["hidden"], lr=hidden["lr"], weight_decay=hidden["wd"],
                                momentum=hidden["momentum"], nesterov=hidden["nesterov"], ns_steps=hidden["ns_steps"],
                                adjust_lr_fn=hidden["update_scale"])
        adamw = torch.optim.AdamW([dict(params=groups["embedding"], lr=adam["lr_embedding"]),
                                   dict(params=groups["head"], lr=adam["lr_head"]),
                                   dict(params=groups["norm"], lr=adam["lr_norm"])],
                                  betas=tuple(adam["betas"]), eps=adam["eps"], weight_decay=adam["wd"])
        head_dim = DIM // HEADS
        losses, largest, clipped = [], [], []
        for step in range(1, STEPS + 1):
            batch = torch.stack([tokens[p * SEQ:p * SEQ + SEQ + 1]
                                 for p in range((step - 1) * BATCH, step * BATCH)]).long()
            watched.clear()
            logits = model(batch[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
            model.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"])
            muon.step()
            adamw.step()
            n = 0
            with torch.no_grad():  # QK-clip
                for l, layer in enumerate(model.model.layers):
                    S = watched[l].double()
                    gamma = torch.where(S > tau, tau / S, torch.ones_like(S))
                    n += int((S > tau).sum())
                    kv_gamma = gamma.view(KV_HEADS, HEADS // KV_HEADS).amin(1)
                    q_rows = gamma.pow(ALPHA).repeat_interleave(head_dim).float()
                    k_rows = kv_gamma.pow(1 - ALPHA).repeat_interleave(head_dim).float()
                    layer.self_attn.q_proj.weight.mul_(q_rows.unsqueeze(1))
                    layer.self_attn.k_proj.weight.mul_(k_rows.unsqueeze(1))
            losses.append(loss.item())
            largest.append([watched[l].max().item() for l in range(LAYERS)])
            clipped.append(n)
        return losses, largest, clipped, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        modeling_llama.eager_attention_forward = original


def test_qk_clip_against_transformers(work):
    tmp = str(work)
    tokens = make_data(tmp)
    config, init = make_model(tmp)
    cfg = subprocess.run([str(TRAIN_FSDP), *args(tmp, 1.0), "--print-config"], capture_output=True, text=True,
                         check=True)
    import json
    cfg = json.loads(cfg.stdout)
    # τ below every block's largest logit at the first step (the reference without the clip).
    _, first, _, _ = reference(cfg, config, init, tokens, float("inf"))
    tau = round(0.8 * min(first[0]), 4)
    want_losses, want_largest, want_clipped, want_params = reference(cfg, config, init, tokens, tau)
    assert want_clipped[0] > 0, "the threshold must fire"
    for name, ranks, extra in (("one", 1, []), ("tp2", 2, ["--parallel.tp", "2"])):
        own = [*args(tmp, tau), *extra, "--logging.metrics_file", f"{tmp}/{name}.jsonl", "--ckpt.path",
               f"{tmp}/{name}_ckpt"]
        if ranks == 1:
            assert start([str(TRAIN_FSDP), *own], f"{tmp}/{name}.log").wait() == 0, open(f"{tmp}/{name}.log").read()[-3000:]
        else:
            run_ranks(ranks, f"{tmp}/{name}.log", *own)
        records = metrics(f"{tmp}/{name}.jsonl")
        assert len(records) == STEPS
        got_losses = [r["loss"] for r in records]
        got_largest = [[r["max_attention_logit"][f"layers.{l}"] for l in range(LAYERS)] for r in records]
        got_clipped = [r["qk_clipped_heads"] for r in records]
        params = exported(f"{tmp}/{name}_ckpt/step_{STEPS:08d}")
        worst_loss = max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses))
        worst_logit = max(abs(a - b) / abs(b) for g, w in zip(got_largest, want_largest) for a, b in zip(g, w))
        worst_param = max((params[k] - v).abs().max().item() for k, v in want_params.items() if k in params)
        print(f"{name}: tau {tau}, heads clipped {got_clipped}; largest relative difference from the reference: loss "
              f"{worst_loss:.2e}, logit {worst_logit:.2e}; parameter {worst_param:.2e}")
        assert sorted(params) == sorted(k for k in want_params if "rotary" not in k), name
        assert worst_loss < 1e-5, f"{name}: a loss differs by {worst_loss:.2e}"
        assert worst_logit < 1e-5, f"{name}: a block's largest logit differs by {worst_logit:.2e}"
        assert got_clipped == want_clipped, f"{name}: heads clipped {got_clipped} against {want_clipped}"
        assert worst_param < 1e-4, f"{name}: a parameter differs by {worst_param:.2e}"
