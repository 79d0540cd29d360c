"""A mixture of experts trained by train_fsdp against an independent PyTorch reference (issue 62).

The reference is transformers' MixtralForCausalLM (softmax routing over the experts, top-k,
renormalised) from the same initial weights, trained on the same batches by torch.optim: Muon for
every hidden matrix, each expert's w1, w2 and w3 a matrix of its own (Mixtral stores w1 and w3 of
an expert as one [2F, D] tensor, which Muon must not orthogonalise whole: they are stepped as
separate parameters and copied back), the router's gate included, and AdamW for the embedding, the
head and the norms, after torch.nn.utils.clip_grad_norm_. Newton-Schulz runs in fp32, as ours on
the CPU.

Runs, each a real process (ranks over loopback Gloo with torchrun's variables):
  one        1 process
  fsdp2      2 ranks sharding every parameter (the experts' stacks by whole experts), with
             activation checkpointing: the routing's counts must not be doubled by recomputation
  ep2        expert parallelism over 2 ranks: each computes its 2 experts for both ranks' tokens
  ep2_fsdp2  4 ranks, EP groups of 2 (strided), FSDP over all 4
  ep4        4 ranks, one expert each, with activation checkpointing (the exchange runs again)
  ep2_tp2    TP 2 x FSDP 2, EP over the 2 shard ranks: attention split by TP, the routed experts whole
             on both TP ranks, each routing its own positions
  ep2_hsdp   HSDP 2 x 2, EP over each shard group
  ep2_cp2    CP 2, EP over the 2 ranks sharing each sequence
Per step each run's loss must equal the reference's within 1e-5; the final parameters (exported to
Mixtral's files by export_hf) within 1e-4. The runs load the reference's initial weights through
ckpt.init_from (Mixtral's files read back).
"""
import json
import os
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import DEBUG_CONFIG, TRAIN_FSDP, metrics, run_ranks, start
from test_diloco import exported, muon_ns_fp32

STEPS, SEQ, BATCH, VOCAB = 20, 32, 8, 128
EXPERTS, TOP_K, EXPERT_HIDDEN, LAYERS = 4, 2, 48, 2


def args(tmp):
    return [
        "--config", str(DEBUG_CONFIG), "--runtime.device", "cpu", "--runtime.num_threads", "1",
        "--model.dim", "64", "--model.n_layers", str(LAYERS), "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.vocab_size", str(VOCAB), "--model.attention", "causal",
        "--model.num_experts", str(EXPERTS), "--model.top_k", str(TOP_K), "--model.route_norm", "true",
        "--model.moe_inter_dim", str(EXPERT_HIDDEN),
        "--data.fake", "false", "--data.shuffle", "false", "--data.dataset_name_or_paths", f"{tmp}/data",
        "--data.seq_length", str(SEQ), "--optim.batch_size", str(BATCH), "--train.micro_bs", "2",
        "--optim.total_steps", str(STEPS), "--optim.sched_type", "wsd-sqrt", "--optim.warmup_steps", "0",
        "--optim.stable_steps", str(STEPS), "--optim.optim.ns_dtype", "float32", "--ckpt.init_from", f"{tmp}/init",
        # As in test_diloco.py: AdamW's g/(sqrt(v) + eps) near eps turns fp32 summation differences into
        # visible ones; a larger eps and a gentler embedding keep the comparison meaningful.
        "--optim.adam.eps", "1e-5", "--optim.adam.lr_embedding", "0.01",
        "--ckpt.interval", str(STEPS),
    ]


def make_data(tmp, steps=STEPS, batch=BATCH, seq=SEQ, vocab=VOCAB, seed=3):
    """A token shard (llm.c's format) of random tokens, enough for every step without repeating."""
    os.makedirs(f"{tmp}/data")
    tokens = torch.randint(0, vocab, (steps * batch * seq + 1,), generator=torch.Generator().manual_seed(seed))
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, tokens.numel()
    with open(f"{tmp}/data/train_000000.bin", "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.numpy().astype(np.uint16).tobytes())
    return tokens


def make_model(tmp):
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=EXPERT_HIDDEN,
                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=2 * SEQ, tie_word_embeddings=False,
                           router_jitter_noise=0.0, output_router_logits=False, sliding_window=None)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).float()
    model.save_pretrained(f"{tmp}/init", safe_serialization=True)
    return config, {k: v.clone() for k, v in model.state_dict().items()}


def reference(cfg, config, init, tokens):
    """Per step the loss; the final parameters in Mixtral's file names."""
    from transformers import MixtralForCausalLM
    muon_ns_fp32()
    model = MixtralForCausalLM(config).float()
    model.load_state_dict(init)
    adam, hidden = cfg["adam"], cfg["hidden"]
    # Muon's parameters: each expert's matrices apart (mirrors of slices of Mixtral's fused
    # tensors), the router's gate and the attention matrices as they are.
    mirrors = []  # (mirror parameter, the tensor it is a slice of, the slice)
    groups = {"hidden": [], "embedding": [], "head": [], "norm": []}
    for name, p in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            for e in range(EXPERTS):
                for s in (slice(0, EXPERT_HIDDEN), slice(EXPERT_HIDDEN, 2 * EXPERT_HIDDEN)):
                    mirrors.append((torch.nn.Parameter(p.detach()[e, s].clone()), p, (e, s)))
        elif name.endswith("experts.down_proj"):
            for e in range(EXPERTS):
                mirrors.append((torch.nn.Parameter(p.detach()[e].clone()), p, (e,)))
        else:
            role = ("embedding" if "embed_tokens" in name else "head" if name.startswith("lm_head")
                    else "norm" if p.dim() < 2 else "hidden")
            groups[role].append(p)
    muon_params = groups["hidden"] + [m for m, _, _ in mirrors]
    muon = torch.optim.Muon(muon_params, lr=hidden["lr"], weight_decay=hidden["wd"], momentum=hidden["momentum"],
                            nesterov=hidden["nesterov"], ns_steps=hidden["ns_steps"],
                            adjust_lr_fn=hidden["update_scale"])
    adamw = torch.optim.AdamW([dict(params=groups["embedding"], lr=adam["lr_embedding"]),
                               dict(params=groups["head"], lr=adam["lr_head"]),
                               dict(params=groups["norm"], lr=adam["lr_norm"])],
                              betas=tuple(adam["betas"]), eps=adam["eps"], weight_decay=adam["wd"])
    losses = []
    for step in range(1, STEPS + 1):
        batch = torch.stack([tokens[p * SEQ:p * SEQ + SEQ + 1] for p in range((step - 1) * BATCH, step * BATCH)]).long()
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        model.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"])
        for m, whole, index in mirrors:
            m.grad = whole.grad[index].clone()
        muon.step()
        adamw.step()
        with torch.no_grad():
            for m, whole, index in mirrors:
                whole[index].copy_(m)
        losses.append(loss.item())
    # Mixtral's file names (as save_pretrained writes them, and export_hf).
    final = {}
    for name, p in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
            for e in range(EXPERTS):
                final[f"{prefix}{e}.w1.weight"] = p[e, :EXPERT_HIDDEN]
                final[f"{prefix}{e}.w3.weight"] = p[e, EXPERT_HIDDEN:]
        elif name.endswith("experts.down_proj"):
            prefix = name.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
            for e in range(EXPERTS):
                final[f"{prefix}{e}.w2.weight"] = p[e]
        else:
            final[name.replace("mlp.gate.weight", "block_sparse_moe.gate.weight")] = p
    return losses, final


def test_mixtral_step(work):
    tmp = str(work)
    tokens = make_data(tmp)
    config, init = make_model(tmp)
    common = args(tmp)
    cfg = subprocess.run([str(TRAIN_FSDP), *common, "--print-config"], capture_output=True, text=True, check=True)
    cfg = json.loads(cfg.stdout)
    # The learning rates stay as configured: no warmup, every step stable.
    assert cfg["schedule"]["type"] == "wsd-sqrt" and cfg["schedule"]["warmup_steps"] == 0
    runs = {"one": (1, []), "fsdp2": (2, ["--train.ac_ckpt", "true"]), "ep2": (2, ["--parallel.ep", "2"]),
            "ep2_fsdp2": (4, ["--parallel.ep", "2"]), "ep4": (4, ["--parallel.ep", "4", "--train.ac_ckpt", "true"]),
            "ep2_tp2": (4, ["--parallel.ep", "2", "--parallel.tp", "2"]),
            "ep2_tp2_alone": (2, ["--parallel.ep", "2", "--parallel.tp", "2"]),  # EP from TP's ranks alone
            "ep2_hsdp": (4, ["--parallel.ep", "2", "--parallel.dp_shard", "2", "--parallel.dp_replicate", "2"]),
            "ep2_cp2": (2, ["--parallel.ep", "2", "--parallel.cp", "2"])}
    for name, (ranks, extra) in runs.items():
        own = [*common, *extra, "--logging.metrics_file", f"{tmp}/{name}.jsonl", "--ckpt.path", f"{tmp}/{name}_ckpt"]
        if ranks == 1:
            assert start([str(TRAIN_FSDP), *own], f"{tmp}/{name}.log").wait() == 0, open(f"{tmp}/{name}.log").read()[-3000:]
        else:
            run_ranks(ranks, f"{tmp}/{name}.log", *own)
    want_losses, want_params = reference(cfg, config, init, tokens)
    for name in runs:
        records = metrics(f"{tmp}/{name}.jsonl")
        got = [r["loss"] for r in records]
        if name.startswith("ep"):  # the tokens did travel to their experts' ranks
            assert all(r["comm_bytes_ep_group"]["all_to_all"] > 0 for r in records), name
        params = exported(f"{tmp}/{name}_ckpt/step_{STEPS:08d}")  # Mixtral's file names
        assert sorted(params) == sorted(want_params), f"{name}: exported {sorted(set(params) ^ set(want_params))}"
        worst_loss = max(abs(a - b) for a, b in zip(got, want_losses))
        worst_param = max((params[k] - v).abs().max().item() for k, v in want_params.items())
        print(f"{name}: losses {[round(x, 5) for x in got]}; largest difference from the reference: loss "
              f"{worst_loss:.2e}, parameter {worst_param:.2e}")
        assert len(got) == STEPS
        assert worst_loss < 1e-5, f"{name}: loss differs by {worst_loss:.2e}"
        assert worst_param < 1e-4, f"{name}: a parameter differs by {worst_param:.2e}"


def deepseek_args(tmp, aux=True):
    """DeepSeek-V3's routing on the same small model: sigmoid scores, 2 groups of which a token
    picks in 1, renormalised and scaled, a shared expert, the first block dense, the balancing bias
    and (aux) the sequence-wise loss."""
    out = [a for a in args(tmp) if a not in ("--ckpt.init_from", f"{tmp}/init")]  # our own initialisation
    out += ["--model.score_func", "sigmoid", "--model.route_scale", "1.5", "--model.num_expert_groups", "2",
                       "--model.num_limited_groups", "1", "--model.num_shared_experts", "1",
                       "--model.n_dense_layers", "1", "--model.n_layers", "3", "--model.load_balance_coeff", "0.01",
                       "--optim.total_steps", "8", "--optim.stable_steps", "8", "--ckpt.interval", "4", "--ckpt.keep", "3"]
    return out + (["--model.aux_loss_coeff", "0.01"] if aux else [])


def test_layouts_and_resume(work):
    """The same run on other layouts gives the same steps: FSDP 2 with activation checkpointing,
    HSDP 2 x 2, CP 2 and TP 2 (without the auxiliary loss, which needs whole sequences; under TP the
    shared expert is split as the MLP is), all with expert parallelism over 2 ranks, DiLoCo 2 x 2
    with and without it, and resumes of
    the one process's step-4 checkpoint on 2 ranks, with and without EP (the biases travel in it). The bias moves each
    step by the counts of every rank (a rank's own would move each rank's bias its own way)."""
    tmp = str(work)
    make_data(tmp)
    runs = {  # name: (ranks, with the auxiliary loss, extra arguments)
        "one": (1, True, []),
        "fsdp2": (2, True, ["--train.ac_ckpt", "true"]),
        "hsdp": (4, True, ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2"]),
        "one_noaux": (1, False, []),
        "cp2": (2, False, ["--parallel.cp", "2"]),
        "hsdp_ep2": (4, True, ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2", "--parallel.ep", "2"]),
        "cp2_ep2": (2, False, ["--parallel.cp", "2", "--parallel.ep", "2"]),
        "tp2": (2, False, ["--parallel.tp", "2"]),
        "tp2_ep2": (4, False, ["--parallel.tp", "2", "--parallel.ep", "2"]),
        "diloco": (4, True, ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2", "--diloco.inner_steps", "2"]),
        "diloco_ep2": (4, True, ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2", "--diloco.inner_steps", "2",
                                 "--parallel.ep", "2"]),
        "resumed": (2, True, ["--ckpt.resume", f"{tmp}/one_ckpt/step_00000004"]),
        "resumed_ep2": (2, True, ["--ckpt.resume", f"{tmp}/one_ckpt/step_00000004", "--parallel.ep", "2"]),
    }
    losses = {}
    for name, (ranks, aux, extra) in runs.items():
        own = [*deepseek_args(tmp, aux), *extra, "--logging.metrics_file", f"{tmp}/{name}.jsonl",
               "--ckpt.path", f"{tmp}/{name}_ckpt"]
        if ranks == 1:
            assert start([str(TRAIN_FSDP), *own], f"{tmp}/{name}.log").wait() == 0, open(f"{tmp}/{name}.log").read()[-3000:]
        else:
            run_ranks(ranks, f"{tmp}/{name}.log", *own)
        records = metrics(f"{tmp}/{name}.jsonl")
        losses[name] = {r["step"]: r["loss"] for r in records}
        spread = [r["experts"]["layers.1"]["bias_spread"] for r in records]
        print(name, [round(x, 6) for x in losses[name].values()], "bias spread", spread)
        assert any(s > 0 for s in spread), f"{name}: the bias never moved"
    for name, want in (("fsdp2", "one"), ("hsdp", "one"), ("cp2", "one_noaux"), ("resumed", "one"),
                       ("hsdp_ep2", "one"), ("cp2_ep2", "one_noaux"), ("tp2", "one_noaux"), ("tp2_ep2", "one_noaux"),
                       ("resumed_ep2", "one"), ("diloco_ep2", "diloco")):
        for step, loss in losses[name].items():
            assert abs(loss - losses[want][step]) < 2e-6, f"{name} step {step}: {loss} against {want}'s {losses[want][step]}"
    assert sorted(losses["resumed"]) == sorted(losses["resumed_ep2"]) == [5, 6, 7, 8]
    assert losses["one"] != losses["one_noaux"]  # the auxiliary loss changes the steps
    assert losses["diloco"][8] != losses["hsdp"][8]  # its replicas trained apart between outer steps
