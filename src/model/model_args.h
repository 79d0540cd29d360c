#pragma once
// Llama model shapes: the llama2 / llama3 size tables, derived sizes, parameter counts and the
// FLOPs-per-token figure used for MFU. Pure arithmetic, no tensors.
#include <cstdint>
#include <string>
#include <vector>

namespace zb {

struct ModelArgs {
  int64_t dim = 4096;
  int64_t n_layers = 32;
  int64_t n_heads = 32;
  int64_t n_kv_heads = 32;
  int64_t vocab_size = 32000;
  int64_t multiple_of = 256;
  double ffn_dim_multiplier = 0.0;  // 0 means "not set"
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  int64_t max_seq_len = 2048;  // the RoPE table covers 2x this many positions

  // Mixture of experts (model/moe.h), torchtitan's names: with num_experts > 0 every block from
  // n_dense_layers on routes each token to top_k of num_experts SwiGLU experts of width
  // moe_inter_dim (0: ffn_hidden()), beside num_shared_experts that every token takes (one dense
  // SwiGLU of their summed width). The router: score_func "softmax" or "sigmoid", route_norm,
  // route_scale and group routing (num_expert_groups, num_limited_groups; 0: none). Balancing:
  // load_balance_coeff, the step of DeepSeek-V3's bias (0: off), aux_loss_coeff, its
  // sequence-wise auxiliary loss (0: off).
  int64_t num_experts = 0;
  int64_t top_k = 1;
  int64_t moe_inter_dim = 0;
  int64_t num_shared_experts = 0;
  int64_t n_dense_layers = 0;
  std::string score_func = "softmax";
  bool route_norm = false;
  double route_scale = 1.0;
  int64_t num_expert_groups = 0;
  int64_t num_limited_groups = 0;
  double load_balance_coeff = 0.0;
  double aux_loss_coeff = 0.0;

  int64_t head_dim() const { return dim / n_heads; }
  // SwiGLU hidden size: 2/3 of 4*dim, times the optional multiplier, rounded up to multiple_of.
  int64_t ffn_hidden() const;
  // Whether block `layer`'s feed-forward is a mixture of experts, and one expert's hidden size.
  bool moe_layer(int64_t layer) const { return num_experts > 0 && layer >= n_dense_layers; }
  int64_t expert_hidden() const { return moe_inter_dim > 0 ? moe_inter_dim : ffn_hidden(); }
  int64_t moe_layers() const;
};

// The size table for type_model "llama2" or "llama3" (vocab_size and max_seq_len are left at
// their defaults; the caller sets them). Throws std::invalid_argument naming the known sizes.
ModelArgs lookup_model_args(const std::string& type_model, const std::string& name_model);
std::vector<std::string> known_model_names(const std::string& type_model);

// One rank's share of what tensor parallelism over `tp` ranks splits (model_parallel/tensor_parallel.h):
// attention heads, key/value heads, FFN columns and vocabulary rows (tp = 1: all of them). With
// fewer key/value heads than ranks each rank holds wk and wv whole and uses one head, shared.
struct TpShare {
  int64_t heads = 0, kv_heads = 0, ffn = 0, vocab = 0;
  bool kv_shared = false;
};
TpShare tp_share(const ModelArgs& args, int64_t tp);

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;  // the whole tensor's, or under tensor parallelism one rank's slice
  int64_t layer = -1;  // the transformer block it belongs to; -1: none (embedding, final norm, head)
  int64_t tp_dim = -1;  // the whole's dimension split over the TP group; -1: each TP rank holds it whole
  std::vector<int64_t> whole;  // the whole tensor's shape (`shape` without TP)
  int64_t numel() const;
};
// Every parameter of the model, in the model's order, with its stable name; with tp > 1 each
// rank's slice under tensor parallelism (model_parallel/tensor_parallel.h: heads, FFN columns and the
// vocabulary split; key/value heads whole when fewer than tp; norms whole).
std::vector<ParamSpec> param_specs(const ModelArgs& args, int64_t tp = 1);

int64_t count_params(const ModelArgs& args);
int64_t count_params_without_embedding(const ModelArgs& args);
// What a token computes with, which MFU counts: without the token embedding, and of the routed
// experts only the top_k a token reaches (all parameters for a dense model).
int64_t count_active_params(const ModelArgs& args);

// Training FLOPs per token: 6*N (N the active parameters) + 12*L*H*Dh*T for attention.
double flops_per_token(const ModelArgs& args, int64_t seq_len);

}  // namespace zb
