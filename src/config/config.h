#pragma once
// The run's configuration: ZeroBand's TOML schema (name_model, type_model, project, [train],
// [optim], [optim.optim], [data]) plus sections of our own ([model], [parallel], [runtime],
// [logging], [profiling], [ckpt], [diloco], [optim.adam]).
// Every key is declared once in schema.cpp, with its allowed values where it is an enumeration;
// loading and overrides (fields.cpp), --help, the unknown-key check and validation
// (validate.cpp) all come from that one list. The model's shapes: config/model_config.h.
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace zb {

// A bad configuration. The message names the key and where it came from (file and line, or the
// command line).
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ModelOverrides {  // [model]: optional changes to the size table entry, and attention
  std::optional<int64_t> dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of;
  std::optional<double> ffn_dim_multiplier, norm_eps, rope_theta;
  // "document": causal within each document of a packed row (ZeroBand's training mask);
  // "causal": across the whole row.
  std::string attention = "document";
  // Mixture of experts (model/model_args.h has what each means; unset: the defaults there).
  std::optional<int64_t> num_experts, top_k, moe_inter_dim, num_shared_experts, n_dense_layers, num_expert_groups,
      num_limited_groups;
  std::string score_func = "softmax";
  std::optional<bool> route_norm;
  std::optional<double> route_scale, load_balance_coeff, aux_loss_coeff;
};

struct TrainConfig {  // [train]
  int64_t micro_bs = 1;
  int64_t ac_ckpt = 0;  // 0: off; N: recompute every N-th block (true = 1)
  bool reshard_after_forward = true;
  bool torch_compile = true;  // accepted for ZeroBand files; there is no compiler in C++
  double bucket_mb = 25;      // train_ddp: gradient all-reduce bucket size
  // Reduce-scatter (all-reduce under DDP) the gradients of every micro-batch and accumulate the
  // shards, instead of accumulating whole fp32 gradients until the last: "true", "false" or "auto"
  // (on where the memory estimate says the run fits only that way; plan/memory_estimate.h).
  std::string reduce_every_micro_batch = "auto";
  // One rank per shard group: keep the compute-dtype casts of the parameters across the step
  // ("true", "false"; "auto": on a GPU where the memory estimate says the run fits with them).
  std::string keep_unsharded = "auto";
  // A step whose loss or gradient norm is not finite is never applied. "stop": the run stops
  // (exit 1); "skip": it goes on, and stops after max_skipped_steps such steps in a row.
  std::string nonfinite = "stop";
  int64_t max_skipped_steps = 5;
};

struct ParallelConfig {  // [parallel]
  // Hybrid sharding (HSDP): parameters are sharded over groups of dp_shard consecutive ranks (a
  // node, under torchrun or SLURM) and replicated over dp_replicate such groups. Their product is
  // the world size; dp_shard = -1 is "the rest" (world size / dp_replicate). The default is
  // FSDP: one group of every rank.
  int64_t dp_shard = -1;
  int64_t dp_replicate = 1;
  // Tensor parallelism (model_parallel/tensor_parallel.h): groups of tp consecutive ranks (within a node)
  // each hold a slice of every matrix and see the same batch; tp x dp_shard x dp_replicate =
  // the world size, and dp_shard = -1 is then world size / (tp x dp_replicate).
  int64_t tp = 1;
  // Context parallelism (model_parallel/context_parallel.h): each row's tokens split over groups of cp
  // ranks (inside the TP groups' stride), which read the same rows; FSDP shards over dp_shard x cp
  // ranks. cp x tp x dp_shard x dp_replicate = the world size.
  int64_t cp = 1;
  // How attention sees the row under CP: "allgather" the keys and values once per block, or pass
  // them around the group while computing ("ring": less memory, more steps).
  std::string cp_rotate = "allgather";
  // Muon under hybrid sharding: each replica orthogonalises every R-th of its owned matrices and
  // an all-reduce over the replicas shares the results (less Newton-Schulz per rank, more traffic
  // across nodes; measured faster on CPU, docs/BENCHMARKS.md), else every replica does them all.
  bool muon_split_over_replicas = true;
  // Muon under tensor parallelism (optim/tensor_parallel_muon.h): "gather" each split matrix to an
  // owner in the TP group, "split" (Newton-Schulz distributed over the slices) or "auto" (per
  // matrix, whichever moves fewer bytes).
  std::string muon_tp = "auto";
  // Expert parallelism (model/moe.h): a mixture's experts split whole over groups of ep ranks of
  // the shard group, each routing its own tokens to the ranks that hold their experts.
  int64_t ep = 1;
};

struct OptimizerConfig {  // [optim.optim]
  std::string type = "muon";  // for the hidden matrices ("adamw": everything AdamW, the baseline)
  double lr = 2e-2;           // the hidden matrices' learning rate
  double wd = 0.01;
  double momentum = 0.95;
  int64_t ns_steps = 5;
  // Ours (Muon's details; ZeroBand's behaviour by default):
  bool nesterov = true;
  std::string update_scale = "original";  // Muon's lr scale
  std::string ns_dtype = "auto";          // Newton-Schulz precision: auto is bf16 on CUDA, fp32 on CPU
  std::string ns_coefficients = "jordan";  // each Newton-Schulz step's (a, b, c): optim/muon.h
  std::string ns_algorithm = "standard";   // "gram": Gram Newton-Schulz where it pays (optim/muon.h)
  // QK-clip (Kimi K2's MuonClip; optim/qk_clip.h): after each step, the query and key rows of every
  // head whose largest attention logit passed the threshold scale down to it (0: off).
  double qk_clip_threshold = 0;
  double qk_clip_alpha = 0.5;  // the query rows take γ^α, the key rows γ^(1-α)
};

struct AdamConfig {  // [optim.adam] (ours): the AdamW groups, ZeroBand's values by default
  double lr_embedding = 0.6;
  double lr_head = 0.008;
  double lr_norm = 0.04;
  double betas1 = 0.8;
  double betas2 = 0.95;
  double eps = 1e-10;
  double wd = 0.01;
};

struct OptimConfig {  // [optim]
  std::string sched_type = "cosine";
  int64_t warmup_steps = 1000;
  int64_t stable_steps = 80000;
  int64_t total_steps = 88000;
  int64_t batch_size = 512;  // global sequences per optimizer step
  double max_norm = 1.0;     // gradient clipping by global norm (ZeroBand hard-codes 1.0)
  OptimizerConfig optim;
  AdamConfig adam;
};

struct DataConfig {  // [data]
  std::string dataset_name_or_paths = "datasets/fineweb-edu";
  std::optional<std::string> val_dataset_name_or_paths;
  int64_t seq_length = 1024;
  bool fake = false;
  int64_t num_workers = 4;
  std::optional<int64_t> max_train_samples, max_eval_samples;
  std::optional<std::string> dataset_ratio;
  std::optional<int64_t> data_rank, data_world_size;
  bool reverse_data_files = false;
  bool split_by_data_rank = true;
  // Ours:
  bool shuffle = true;         // a seeded permutation of the samples each epoch
  int64_t eval_interval = 0;   // validation loss every N steps (0 = never); needs val data
  int64_t eval_batches = 4;    // micro-batches per rank in each validation
  // The token that marks documents in the shards, where their meta.json does not say
  // (data/documents.h), and whether it "closes" (follows) or "opens" (precedes) each document.
  std::optional<int64_t> document_token;
  std::string document_token_position = "closes";
};

struct RuntimeConfig {  // [runtime]
  std::string device = "auto";         // "auto": cuda when available
  std::string compute_dtype = "auto";  // "auto": bf16 on cuda, fp32 on cpu
  int64_t seed = 42;
  int64_t num_threads = 0;  // intra-op CPU threads; 0 = LibTorch's default
  double peak_flops = 0;    // per device, for MFU; 0 = from the GPU's name
  int64_t timeout_s = 300;  // rendezvous and collectives fail after this long
  double device_memory_gb = 0;  // one device's memory for the fit check; 0: from the GPU's name
  std::string sdpa_backend = "auto";  // scaled_dot_product_attention's kernel (model/attention.h)
  std::string varlen_kernel = "flash";  // document attention's kernel on a GPU (model/attention.h)
  bool cp_varlen = false;  // CP (allgather) through the variable-length kernel on a GPU (model_parallel/context_parallel.h)
  bool fused_kernels = true;  // our fused operators and CUDA kernels (model/layers.h); false: none
  std::string unfused;        // those of them to leave to ATen, comma-separated (model/layers.h's names)
  std::string backend = "auto";  // collectives: "auto" | "nccl" | "gloo" (dist/placement.h)
  bool deterministic = false;    // bit-identical reruns on a GPU (util/device.h's use_deterministic_algorithms)
};

struct CheckpointConfig {  // [ckpt]
  std::string path;      // directory of checkpoints ("" = no checkpoints)
  int64_t interval = 0;  // save every N steps (0 = only at the end and on SIGTERM/SIGINT)
  int64_t keep = 3;      // newest checkpoints kept (0 = all)
  std::string resume;    // a checkpoint directory, or "latest" (the newest in path)
  std::string init_from;  // a Hugging Face model directory for the initial weights
};

struct LoggingConfig {  // [logging]
  std::string level = "info";
  std::string metrics_file;  // JSON lines; "" = outputs/<name_model>-<time>/metrics.jsonl
  int64_t interval = 1;      // console line every N steps
  std::string tensorboard_dir;  // "" = none; else the metrics follower writes event files there
  // Each block's largest pre-softmax attention logit a step, in the metrics (always with QK-clip).
  bool max_attention_logit = false;
};

struct ProfilingConfig {  // [profiling], torchtitan's names
  bool enable_profiling = false;
  std::string save_traces_folder = "profile_traces";  // relative: beside the metrics file
  int64_t profile_freq = 10;    // a window of steps recorded every N steps, ending at multiples of N
  int64_t profile_active = 1;   // steps in a window
  bool profile_memory = false;  // allocations in the traces (a memory timeline)
  bool nvtx = false;            // CUDA: every phase and operator as an NVTX range, the whole run
};

struct DilocoConfig {  // [diloco], prime's names: DiLoCo over the replicas (diloco/diloco.h)
  // Inner steps between outer synchronisations; 0: DiLoCo off (each step's gradients are
  // averaged over every rank, the default).
  int64_t inner_steps = 0;
  double outer_lr = 0.7;        // the outer Nesterov SGD's learning rate
  double outer_momentum = 0.9;  // and its momentum
  // How the pseudo-gradients cross between replicas: "none" (fp32), "bf16" or "uint8" (a
  // per-chunk quantiser with its table, dist/compression.h); summed in fp32 on arrival.
  std::string compression = "none";
  // Streaming: the blocks in `fragments` groups synced at staggered steps, each exchange applied
  // `fragment_delay` steps after it starts (overlapping the inner steps between).
  int64_t fragments = 1;
  int64_t fragment_delay = 0;
  // Elastic replicas: "host:port" of the run's membership service (apps/diloco_peers.cpp). Each
  // launch is then one replica, and replicas may leave without stopping the others
  // (diloco/membership.h); optim.batch_size is each replica's batch. "": the replicas are the
  // parallel.dp_replicate shard groups of one launch.
  std::string peers;
  // With peers: this replica joins the running run at its next outer step (diloco/membership.h),
  // taking the outer state from a live replica, and its inner optimizer state "fresh" (new, or
  // its own checkpoint's under ckpt.resume) or from that "peer".
  bool join = false;
  std::string join_state = "fresh";
};

struct Float8Config {  // [float8], torchtitan's names: FP8 linears (float8/float8.h)
  bool enable_float8_linear = false;  // the block projections in FP8 (a GPU with FP8 tensor cores)
  std::string recipe_name = "tensorwise";  // "tensorwise" | "rowwise" | "rowwise_with_gw_hp"
  std::vector<std::string> filter_fqns = {"output"};  // projections left in the compute dtype, by name part
  bool enable_fsdp_float8_all_gather = false;  // FSDP gathers those weights in FP8 (tensorwise): half the bytes
  // torchtitan's batching of the FP8 gather's amaxes into one collective a step: ours always does
  // it, so true is accepted (with the FP8 gather) and false refused.
  bool precompute_float8_dynamic_scale_for_fsdp = true;
  bool emulate = false;  // the same FP8 values multiplied in fp32, on any device (for tests)
};

struct Config {
  std::string name_model = "150M";
  std::string type_model = "llama3";
  std::string project = "prime_simple";
  bool wandb = true;  // ZeroBand's default: the metrics follower sends the run to W&B
  ModelOverrides model;
  TrainConfig train;
  ParallelConfig parallel;
  OptimConfig optim;
  DataConfig data;
  RuntimeConfig runtime;
  LoggingConfig logging;
  ProfilingConfig profiling;
  CheckpointConfig ckpt;
  DilocoConfig diloco;
  Float8Config float8;

  std::string source = "<defaults>";  // the file it was loaded from
  // Where each key that was set came from ("file:line" or "command line"), for error messages.
  std::map<std::string, std::string> origins;
  std::string origin(const std::string& key) const;
};

// Loads a TOML file. Throws ConfigError on unknown keys or sections, wrong types, a missing
// [train] section or a file that does not parse.
Config load_config_file(const std::string& path);
// Parses TOML text (`source` names it in error messages).
Config load_config_string(const std::string& text, const std::string& source);

// Applies one dotted override such as ("optim.optim.lr", "0.01"); for a boolean key an empty
// value means true. Throws ConfigError naming the key.
void apply_override(Config& config, const std::string& key, const std::string& value);

// Checks everything that can be checked before work starts, for a run on `world_size` processes:
// impossible combinations, unknown enumerations, shapes that do not divide. Throws ConfigError.
void validate(const Config& config, int64_t world_size);

// One help line per key: (dotted key, type, default, description). An enumeration's type is
// "one of a | b | c".
struct KeyHelp {
  std::string key, type, default_value, description;
};
std::vector<KeyHelp> config_keys();

// Training arithmetic shared by the loop and the logs. The ranks that read different rows of a
// batch: the world over parallel.tp x parallel.cp (a TP or CP group reads the same rows).
int64_t data_parallel_size(const Config& config, int64_t world_size);
int64_t grad_accum_steps(const Config& config, int64_t world_size);
// data.dataset_ratio "70:30" as weights, one per dataset; throws std::invalid_argument for
// anything else.
std::vector<double> parse_ratio(const std::string& ratio, size_t expected_count);

// parallel.dp_shard resolved on `world_size` ranks: -1 is the rest of the world once parallel.tp
// and parallel.dp_replicate are taken (parallel/mesh.h arranges the ranks).
int64_t resolved_dp_shard(const Config& config, int64_t world_size);

}  // namespace zb
