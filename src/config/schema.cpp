// The configuration schema: every key of config.h's structs, once, with its kind, help text and,
// for enumerations, its allowed values. Order here is the order of --help.
#include "config/fields.h"

namespace zb {

// ZB_FIELD: a key of any kind; the setter receives a value already checked against KIND.
// ZB_CHOICE: a string key with its allowed values, which validation enforces and --help lists.
#define ZB_FIELD(KEY, KIND, CPP, MEMBER, HELP)                                                  \
  Field {                                                                                       \
    KEY, Kind::KIND, HELP, {}, [](Config& c, const Value& v) { c.MEMBER = std::get<CPP>(v); },  \
        [](const Config& c) { return show(c.MEMBER); }                                          \
  }
#define ZB_CHOICE(KEY, MEMBER, HELP, ...)                                                       \
  Field {                                                                                       \
    KEY, Kind::String, HELP, {__VA_ARGS__},                                                     \
        [](Config& c, const Value& v) { c.MEMBER = std::get<std::string>(v); },                \
        [](const Config& c) { return show(c.MEMBER); }                                          \
  }

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      ZB_FIELD("name_model", String, std::string, name_model,
               "model size from the table: debugmodel, 70M, 150M, 271M, 1B, 7B, ... (llama2); "
               "debugmodel, 1B, 8B, ... (llama3)"),
      ZB_CHOICE("type_model", type_model, "the size table name_model is from", "llama2", "llama3"),
      ZB_FIELD("project", String, std::string, project, "project name, shown in logs and metrics"),
      ZB_FIELD("wandb", Bool, bool, wandb,
               "send the metrics to Weights & Biases (rank 0 starts scripts/watch/follow_metrics.py; "
               "offline without credentials or network)"),

      ZB_FIELD("model.dim", Int, int64_t, model.dim, "override the table's model width"),
      ZB_FIELD("model.n_layers", Int, int64_t, model.n_layers, "override the number of blocks"),
      ZB_FIELD("model.n_heads", Int, int64_t, model.n_heads, "override the attention heads"),
      ZB_FIELD("model.n_kv_heads", Int, int64_t, model.n_kv_heads,
               "override the key/value heads (grouped-query attention)"),
      ZB_FIELD("model.vocab_size", Int, int64_t, model.vocab_size,
               "vocabulary (default: 1024 for debugmodel on fake data, 32000 llama2, 128256 llama3)"),
      ZB_FIELD("model.multiple_of", Int, int64_t, model.multiple_of, "FFN size rounding"),
      ZB_FIELD("model.ffn_dim_multiplier", Float, double, model.ffn_dim_multiplier,
               "FFN size multiplier"),
      ZB_FIELD("model.norm_eps", Float, double, model.norm_eps, "RMSNorm epsilon (default 1e-5)"),
      ZB_FIELD("model.rope_theta", Float, double, model.rope_theta, "RoPE base"),
      ZB_CHOICE("model.attention", model.attention,
                "document: causal within each packed document (ZeroBand's mask); causal: across the row",
                "document", "causal"),
      ZB_FIELD("model.num_experts", Int, int64_t, model.num_experts,
               "mixture of experts: routed experts per MoE block (0: every block dense)"),
      ZB_FIELD("model.top_k", Int, int64_t, model.top_k, "mixture of experts: the experts each token reaches"),
      ZB_FIELD("model.moe_inter_dim", Int, int64_t, model.moe_inter_dim,
               "mixture of experts: one expert's hidden size (default: the dense FFN's)"),
      ZB_FIELD("model.num_shared_experts", Int, int64_t, model.num_shared_experts,
               "mixture of experts: experts every token takes (one dense SwiGLU of their summed width)"),
      ZB_FIELD("model.n_dense_layers", Int, int64_t, model.n_dense_layers,
               "mixture of experts: the first blocks that stay dense"),
      ZB_CHOICE("model.score_func", model.score_func,
                "mixture of experts: the router's scores, softmax over the experts (Mixtral) or a sigmoid each "
                "(DeepSeek-V3)",
                "softmax", "sigmoid"),
      ZB_FIELD("model.route_norm", Bool, bool, model.route_norm,
               "mixture of experts: a token's expert weights divided by their sum (Mixtral: true)"),
      ZB_FIELD("model.route_scale", Float, double, model.route_scale,
               "mixture of experts: the expert weights multiplied by this (default 1)"),
      ZB_FIELD("model.num_expert_groups", Int, int64_t, model.num_expert_groups,
               "mixture of experts: group routing's groups of experts (0: none)"),
      ZB_FIELD("model.num_limited_groups", Int, int64_t, model.num_limited_groups,
               "mixture of experts: group routing's best groups a token chooses its experts in"),
      ZB_FIELD("model.load_balance_coeff", Float, double, model.load_balance_coeff,
               "mixture of experts: DeepSeek-V3's balancing bias, its move per step (0: off)"),
      ZB_FIELD("model.aux_loss_coeff", Float, double, model.aux_loss_coeff,
               "mixture of experts: the sequence-wise auxiliary balancing loss's weight (0: off)"),

      ZB_FIELD("parallel.dp_shard", Int, int64_t, parallel.dp_shard,
               "hybrid sharding: ranks per shard group, consecutive (a node); -1 = world size / "
               "dp_replicate"),
      ZB_FIELD("parallel.dp_replicate", Int, int64_t, parallel.dp_replicate,
               "hybrid sharding: shard groups holding replicas (1 = FSDP over every rank)"),
      ZB_FIELD("parallel.tp", Int, int64_t, parallel.tp,
               "tensor parallelism: ranks per TP group, consecutive (within a node); tp x dp_shard x "
               "dp_replicate = world size"),
      ZB_FIELD("parallel.cp", Int, int64_t, parallel.cp,
               "context parallelism: ranks splitting each row's tokens (two chunks each, for balance under the "
               "causal mask), keys and values gathered per layer; FSDP shards over dp_shard x cp; cp x tp x "
               "dp_shard x dp_replicate = world size"),
      ZB_CHOICE("parallel.cp_rotate", parallel.cp_rotate,
                "context parallelism's attention: allgather the row's keys and values in every block (one "
                "collective each way), or ring: pass them around the group while computing (cp - 1 steps, no "
                "whole row in memory)",
                "allgather", "ring"),
      ZB_FIELD("parallel.muon_split_over_replicas", Bool, bool, parallel.muon_split_over_replicas,
               "hybrid sharding: replicas share Muon's Newton-Schulz work (an all-reduce across them) "
               "instead of each doing all of it"),
      ZB_CHOICE("parallel.muon_tp", parallel.muon_tp,
                "tensor parallelism: how Muon orthogonalises a matrix split over a TP group: gather "
                "(to an owner, whole), split (Newton-Schulz on the slices, a Gram matrix all-reduced per "
                "iteration) or auto (whichever moves fewer bytes)",
                "auto", "gather", "split"),
      ZB_FIELD("parallel.ep", Int, int64_t, parallel.ep,
               "expert parallelism: ranks of a shard group (dp_shard x cp) a mixture's experts are split over, "
               "whole; each sends its tokens' rows to the experts' ranks and back (all-to-alls)"),
      ZB_FIELD("train.micro_bs", Int, int64_t, train.micro_bs,
               "sequences per forward/backward on one rank"),
      Field{"train.ac_ckpt", Kind::BoolOrInt,
            "activation checkpointing: false, true (every block) or N (every N-th block)",
            {},
            [](Config& c, const Value& v) {
              c.train.ac_ckpt = std::holds_alternative<bool>(v) ? (std::get<bool>(v) ? 1 : 0)
                                                                : std::get<int64_t>(v);
            },
            [](const Config& c) { return c.train.ac_ckpt == 0 ? std::string("false") : show(c.train.ac_ckpt); }},
      ZB_FIELD("train.reshard_after_forward", Bool, bool, train.reshard_after_forward,
               "free gathered block parameters after forward (FSDP)"),
      ZB_FIELD("train.torch_compile", Bool, bool, train.torch_compile,
               "accepted for ZeroBand configs; ignored (no compiler in C++)"),

      ZB_CHOICE("train.nonfinite", train.nonfinite,
                "a step with a non-finite loss or gradient norm is never applied; then stop the "
                "run (exit 1) or skip the step and go on",
                "stop", "skip"),
      ZB_FIELD("train.max_skipped_steps", Int, int64_t, train.max_skipped_steps,
               "train.nonfinite = \"skip\": stop after this many non-finite steps in a row"),
      Field{"train.reduce_every_micro_batch", Kind::BoolOrAuto,
            "reduce the gradients of every micro-batch and accumulate shards (memory: no whole fp32 "
            "accumulators; traffic: one reduction per micro-batch) or only the last micro-batch's "
            "(false); auto: the memory estimate decides (on where whole fp32 sums do not fit)",
            {},
            [](Config& c, const Value& v) {
              c.train.reduce_every_micro_batch = std::holds_alternative<bool>(v)
                                                     ? (std::get<bool>(v) ? "true" : "false")
                                                     : std::get<std::string>(v);
            },
            [](const Config& c) {
              const std::string& v = c.train.reduce_every_micro_batch;
              return v == "auto" ? show(v) : v;  // a TOML string or boolean
            }},
      Field{"train.keep_unsharded", Kind::BoolOrAuto,
            "with one rank per shard group, where gathering parameters is casting them to the compute "
            "dtype: keep the casts for the whole step (one cast a step, the whole model's cast in memory) "
            "instead of freeing them after forward and backward (false); auto: on a GPU where the memory "
            "estimate says the run fits with them",
            {},
            [](Config& c, const Value& v) {
              c.train.keep_unsharded = std::holds_alternative<bool>(v) ? (std::get<bool>(v) ? "true" : "false")
                                                                       : std::get<std::string>(v);
            },
            [](const Config& c) {
              const std::string& v = c.train.keep_unsharded;
              return v == "auto" ? show(v) : v;
            }},
      ZB_FIELD("train.bucket_mb", Float, double, train.bucket_mb,
               "train_ddp: size of the gradient all-reduce buckets in MiB"),
      ZB_CHOICE("optim.sched_type", optim.sched_type, "learning-rate schedule", "cosine", "linear",
                "wsd-sqrt"),
      ZB_FIELD("optim.warmup_steps", Int, int64_t, optim.warmup_steps, "linear warmup steps"),
      ZB_FIELD("optim.stable_steps", Int, int64_t, optim.stable_steps,
               "wsd-sqrt: step where the decay starts"),
      ZB_FIELD("optim.total_steps", Int, int64_t, optim.total_steps, "optimizer steps to run"),
      ZB_FIELD("optim.batch_size", Int, int64_t, optim.batch_size,
               "global batch in sequences per optimizer step"),
      ZB_FIELD("optim.max_norm", Float, double, optim.max_norm,
               "clip gradients to this global L2 norm (0 = no clipping)"),
      ZB_CHOICE("optim.optim.type", optim.optim.type,
                "optimizer for the hidden matrices (adamw: AdamW for everything, the baseline)",
                "muon", "adamw"),
      ZB_FIELD("optim.optim.lr", Float, double, optim.optim.lr,
               "learning rate of the hidden matrices"),
      ZB_FIELD("optim.optim.wd", Float, double, optim.optim.wd, "decoupled weight decay"),
      ZB_FIELD("optim.optim.momentum", Float, double, optim.optim.momentum, "Muon momentum"),
      ZB_FIELD("optim.optim.ns_steps", Int, int64_t, optim.optim.ns_steps,
               "Muon Newton-Schulz iterations"),
      ZB_FIELD("optim.optim.nesterov", Bool, bool, optim.optim.nesterov,
               "Muon: Nesterov blend of gradient and momentum"),
      ZB_CHOICE("optim.optim.update_scale", optim.optim.update_scale,
                "Muon lr scale: original is sqrt(max(1, rows/cols)), match_rms_adamw is "
                "0.2*sqrt(max(rows, cols))",
                "original", "match_rms_adamw"),
      ZB_CHOICE("optim.optim.ns_dtype", optim.optim.ns_dtype,
                "Muon Newton-Schulz precision (auto: bfloat16 on cuda, float32 on cpu)", "auto", "bfloat16",
                "float32"),
      ZB_CHOICE("optim.optim.ns_coefficients", optim.optim.ns_coefficients,
                "Muon Newton-Schulz steps: jordan (Keller Jordan's quintic, every step) or polar_express "
                "(Polar Express's minimax step for each, singular values nearer 1)",
                "jordan", "polar_express"),
      ZB_CHOICE("optim.optim.ns_algorithm", optim.optim.ns_algorithm,
                "Muon Newton-Schulz algorithm: standard, or gram (Gram Newton-Schulz: the same steps on the "
                "short side's Gram matrix, in fp16 where ns_dtype is 16-bit, for the matrices where it counts "
                "fewer multiply-adds: long side over 1.5x the short one; a matrix parallel.muon_tp = split leaves "
                "in slices iterates the standard way)",
                "standard", "gram"),
      ZB_FIELD("optim.optim.qk_clip_threshold", Float, double, optim.optim.qk_clip_threshold,
               "QK-clip (MuonClip): after each step, scale the query and key rows of a head whose largest "
               "attention logit passed this down to it (0 = off; Kimi K2 used 100)"),
      ZB_FIELD("optim.optim.qk_clip_alpha", Float, double, optim.optim.qk_clip_alpha,
               "QK-clip: the query rows take gamma^alpha, the key rows gamma^(1 - alpha)"),
      ZB_FIELD("optim.adam.lr_embedding", Float, double, optim.adam.lr_embedding,
               "AdamW lr of the token embedding"),
      ZB_FIELD("optim.adam.lr_head", Float, double, optim.adam.lr_head, "AdamW lr of the output head"),
      ZB_FIELD("optim.adam.lr_norm", Float, double, optim.adam.lr_norm, "AdamW lr of the norm weights"),
      ZB_FIELD("optim.adam.betas1", Float, double, optim.adam.betas1, "AdamW beta1"),
      ZB_FIELD("optim.adam.betas2", Float, double, optim.adam.betas2, "AdamW beta2"),
      ZB_FIELD("optim.adam.eps", Float, double, optim.adam.eps, "AdamW epsilon"),
      ZB_FIELD("optim.adam.wd", Float, double, optim.adam.wd,
               "AdamW decoupled weight decay of the embedding, head and norm groups"),

      ZB_FIELD("data.dataset_name_or_paths", String, std::string, data.dataset_name_or_paths,
               "training data: comma-separated paths"),
      ZB_FIELD("data.val_dataset_name_or_paths", String, std::string, data.val_dataset_name_or_paths,
               "validation data"),
      ZB_FIELD("data.seq_length", Int, int64_t, data.seq_length, "tokens per sequence"),
      ZB_FIELD("data.fake", Bool, bool, data.fake, "random tokens instead of a dataset"),
      ZB_FIELD("data.num_workers", Int, int64_t, data.num_workers, "data loading workers"),
      ZB_FIELD("data.max_train_samples", Int, int64_t, data.max_train_samples,
               "accepted for ZeroBand configs (unused there too)"),
      ZB_FIELD("data.max_eval_samples", Int, int64_t, data.max_eval_samples,
               "accepted for ZeroBand configs (unused there too)"),
      ZB_FIELD("data.dataset_ratio", String, std::string, data.dataset_ratio,
               "mixing ratio of the datasets, \"a:b:...\""),
      ZB_FIELD("data.data_rank", Int, int64_t, data.data_rank, "accepted for ZeroBand configs"),
      ZB_FIELD("data.data_world_size", Int, int64_t, data.data_world_size,
               "accepted for ZeroBand configs"),
      ZB_FIELD("data.reverse_data_files", Bool, bool, data.reverse_data_files,
               "read the data files in reverse order"),
      ZB_FIELD("data.split_by_data_rank", Bool, bool, data.split_by_data_rank,
               "accepted for ZeroBand configs"),

      ZB_FIELD("data.shuffle", Bool, bool, data.shuffle,
               "visit the samples in a seeded random order, a new one each epoch"),
      ZB_FIELD("data.eval_interval", Int, int64_t, data.eval_interval,
               "validation loss every N steps on data.val_dataset_name_or_paths (0 = never)"),
      ZB_FIELD("data.eval_batches", Int, int64_t, data.eval_batches,
               "micro-batches per rank averaged in each validation"),
      ZB_FIELD("data.document_token", Int, int64_t, data.document_token,
               "the token marking documents, where the shards' meta.json does not say"),
      ZB_CHOICE("data.document_token_position", data.document_token_position,
                "whether data.document_token closes (follows) or opens (precedes) a document",
                "closes", "opens"),
      ZB_CHOICE("runtime.device", runtime.device, "where to run (auto: cuda when available)", "auto",
                "cpu", "cuda"),
      ZB_CHOICE("runtime.compute_dtype", runtime.compute_dtype,
                "compute precision (auto: bfloat16 on cuda, float32 on cpu)", "auto", "float32",
                "bfloat16"),
      ZB_FIELD("runtime.seed", Int, int64_t, runtime.seed, "seed of initialisation and data"),
      ZB_FIELD("runtime.num_threads", Int, int64_t, runtime.num_threads,
               "CPU threads per process (0 = LibTorch's default, divided among the ranks on one machine)"),
      ZB_FIELD("runtime.peak_flops", Float, double, runtime.peak_flops,
               "peak FLOP/s of one device for MFU (0 = from the GPU's name)"),

      ZB_FIELD("runtime.timeout_s", Int, int64_t, runtime.timeout_s,
               "seconds before a rendezvous or collective that is not completing fails"),
      ZB_FIELD("runtime.device_memory_gb", Float, double, runtime.device_memory_gb,
               "one device's memory in GB for the memory check before training (0 = from the GPU's name)"),
      ZB_CHOICE("runtime.sdpa_backend", runtime.sdpa_backend,
                "kernel of attention without documents (and of the CPU's document mask): auto is "
                "PyTorch's choice; the metrics name the one that ran",
                "auto", "flash", "cudnn", "efficient", "math"),
      ZB_CHOICE("runtime.varlen_kernel", runtime.varlen_kernel,
                "kernel of attention within documents on a GPU: flash (variable-length flash) or cudnn "
                "(cuDNN's forward over the same cumulative lengths, flash's backward; the metrics name the one "
                "that ran)",
                "flash", "cudnn"),
      ZB_FIELD("runtime.cp_varlen", Bool, bool, runtime.cp_varlen,
               "context parallelism (allgather) on a GPU through the variable-length flash kernel, each piece of a "
               "rank's queries with its document's gathered keys, no mask (not yet measured on a GPU: off by "
               "default, the mask through SDPA)"),
      ZB_FIELD("runtime.fused_kernels", Bool, bool, runtime.fused_kernels,
               "our fused operators: SwiGLU's gate as one autograd node, and on CUDA in bf16 our kernels for "
               "it, RoPE, RMSNorm's backward, the loss's log-sum-exp and logit gradient, q/k/v's input "
               "gradient summed in the GEMMs, the residual adds in the output GEMMs, and the fp32 gradient "
               "sums and Muon's momentum and update in one pass each (false: ATen's operators alone, for comparison)"),
      ZB_FIELD("runtime.unfused", String, std::string, runtime.unfused,
               "of those, the ones to leave to ATen, comma-separated: rope, gate, loss, norm, linears, update, "
               "momentum, residual "
               "(to measure what each gives)"),
      ZB_CHOICE("runtime.backend", runtime.backend,
                "the collectives' backend: nccl between GPUs, one rank each; gloo over TCP (a GPU's tensors "
                "staged through host memory); auto: nccl where every rank has its own GPU, else gloo (ranks "
                "sharing a GPU, said at start-up)",
                "auto", "nccl", "gloo"),
      ZB_FIELD("runtime.deterministic", Bool, bool, runtime.deterministic,
               "bit-identical reruns: ATen's deterministic algorithms (flash attention's deterministic backward "
               "included), cuDNN's deterministic choices and a fixed cuBLAS workspace (costs speed; see "
               "docs/BENCHMARKS.md)"),
      ZB_FIELD("ckpt.path", String, std::string, ckpt.path,
               "directory of checkpoints (\"\" = none)"),
      ZB_FIELD("ckpt.interval", Int, int64_t, ckpt.interval,
               "save every N steps (0 = only at the end and when stopped by SIGTERM/SIGINT)"),
      ZB_FIELD("ckpt.keep", Int, int64_t, ckpt.keep, "newest checkpoints to keep (0 = all)"),
      ZB_FIELD("ckpt.resume", String, std::string, ckpt.resume,
               "resume from a checkpoint directory, or \"latest\" in ckpt.path"),
      ZB_FIELD("ckpt.init_from", String, std::string, ckpt.init_from,
               "initial weights from a Hugging Face model directory (as export_hf writes)"),
      ZB_CHOICE("logging.level", logging.level, "console log level", "debug", "info", "warn", "error"),
      ZB_FIELD("logging.metrics_file", String, std::string, logging.metrics_file,
               "JSON-lines metrics (default outputs/<name_model>-<time>/metrics.jsonl)"),
      ZB_FIELD("logging.interval", Int, int64_t, logging.interval, "console line every N steps"),
      ZB_FIELD("logging.tensorboard_dir", String, std::string, logging.tensorboard_dir,
               "write TensorBoard event files here (rank 0 starts scripts/watch/follow_metrics.py)"),
      ZB_FIELD("logging.max_attention_logit", Bool, bool, logging.max_attention_logit,
               "log each block's largest attention logit a step (QK-clip logs it always)"),
      ZB_FIELD("profiling.enable_profiling", Bool, bool, profiling.enable_profiling,
               "record windows of steps with LibTorch's profiler: a Chrome trace and a summary per rank"),
      ZB_FIELD("profiling.save_traces_folder", String, std::string, profiling.save_traces_folder,
               "where the traces go (relative: beside the metrics file), iteration_<step>/rank<r>_trace.json"),
      ZB_FIELD("profiling.profile_freq", Int, int64_t, profiling.profile_freq,
               "a window every N steps, ending at each multiple of N"),
      ZB_FIELD("profiling.profile_active", Int, int64_t, profiling.profile_active, "steps recorded per window"),
      ZB_FIELD("profiling.profile_memory", Bool, bool, profiling.profile_memory,
               "allocations and frees in the traces (a memory timeline)"),
      ZB_FIELD("profiling.nvtx", Bool, bool, profiling.nvtx,
               "CUDA: every phase and operator as an NVTX range for Nsight Systems, the whole run"),
      ZB_FIELD("diloco.inner_steps", Int, int64_t, diloco.inner_steps,
               "DiLoCo: each replica (shard group) trains alone for N steps, then an outer step over the "
               "replicas; 0 = off"),
      ZB_FIELD("diloco.outer_lr", Float, double, diloco.outer_lr, "DiLoCo: the outer Nesterov SGD's learning rate"),
      ZB_FIELD("diloco.outer_momentum", Float, double, diloco.outer_momentum,
               "DiLoCo: the outer Nesterov SGD's momentum"),
      ZB_CHOICE("diloco.compression", diloco.compression,
                "DiLoCo: pseudo-gradients between replicas as fp32, bf16 or 8-bit codes with a table per chunk",
                "none", "bf16", "uint8"),
      ZB_FIELD("diloco.fragments", Int, int64_t, diloco.fragments,
               "DiLoCo streaming: the blocks in N groups, synced at staggered steps (1/N of the model each)"),
      ZB_FIELD("diloco.fragment_delay", Int, int64_t, diloco.fragment_delay,
               "DiLoCo streaming: steps between an exchange's start and its outer step (overlapped with "
               "inner steps; 0 = at once)"),
      ZB_FIELD("diloco.peers", String, std::string, diloco.peers,
               "DiLoCo elastic replicas: host:port of the run's diloco_peers; this launch is then one replica, "
               "which may leave (or lose others) without stopping the run; \"\" = off"),
      ZB_FIELD("diloco.join", Bool, bool, diloco.join,
               "DiLoCo elastic replicas: join the running run at its next outer step, its state from a live replica"),
      ZB_CHOICE("diloco.join_state", diloco.join_state,
                "DiLoCo elastic replicas: a joiner's inner optimizer state, new (or its own checkpoint's) or the "
                "live replica's",
                "fresh", "peer"),
      ZB_FIELD("float8.enable_float8_linear", Bool, bool, float8.enable_float8_linear,
               "the blocks' projections (wq wk wv wo w1 w2 w3) multiply in FP8 with dynamic scales (a GPU with "
               "FP8 tensor cores, compute capability 8.9 or more; master weights and optimizers unchanged)"),
      ZB_CHOICE("float8.recipe_name", float8.recipe_name,
                "FP8 scaling: one scale per tensor (gradients e5m2), per row (powers of two, all e4m3), or per row "
                "with the weight gradient's GEMM in the compute dtype",
                "tensorwise", "rowwise", "rowwise_with_gw_hp"),
      ZB_FIELD("float8.filter_fqns", StringList, std::vector<std::string>, float8.filter_fqns,
               "projections left in the compute dtype: any whose name (layers.3.feed_forward.w2) contains one of "
               "these (the head and embedding never run in FP8)"),
      ZB_FIELD("float8.enable_fsdp_float8_all_gather", Bool, bool, float8.enable_fsdp_float8_all_gather,
               "the sharding engine gathers the FP8 projections' weights in FP8, half the bytes of bf16 (tensorwise; "
               "their scales from one all-gather of amaxes a step, rounded to powers of two)"),
      ZB_FIELD("float8.precompute_float8_dynamic_scale_for_fsdp", Bool, bool,
               float8.precompute_float8_dynamic_scale_for_fsdp,
               "the FP8 all-gather's scales for the whole model from one collective a step, computed before the "
               "gathers (always so here: false is refused)"),
      ZB_FIELD("float8.emulate", Bool, bool, float8.emulate,
               "FP8 emulated: the same scaled and rounded values multiplied in fp32, on any device (for tests)"),
  };
  return fields;
}
#undef ZB_FIELD
#undef ZB_CHOICE

const std::vector<std::string>& schema_sections() {
  static const std::vector<std::string> sections = {
      "model", "train", "optim", "optim.optim", "optim.adam", "data", "runtime", "logging", "ckpt", "parallel", "profiling", "diloco",
      "float8"};
  return sections;
}

}  // namespace zb
