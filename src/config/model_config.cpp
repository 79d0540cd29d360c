#include "config/model_config.h"

#include <algorithm>
#include <stdexcept>

namespace zb {

ModelArgs resolve_model_args(const Config& c) {
  ModelArgs a;
  try {
    a = lookup_model_args(c.type_model, c.name_model);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(c.origin("name_model") + ": " + e.what());
  }
  // ZeroBand: the fake tokenizer's vocabulary for the debug model on fake data, else the
  // tokenizer of the model family (Mistral 32k for llama2, Llama-3 128k for llama3).
  if (c.data.fake && c.name_model == "debugmodel") a.vocab_size = 1024;
  else a.vocab_size = c.type_model == "llama2" ? 32000 : 128256;
  const auto& m = c.model;
  if (m.dim) a.dim = *m.dim;
  if (m.n_layers) a.n_layers = *m.n_layers;
  if (m.n_heads) a.n_heads = *m.n_heads;
  if (m.n_kv_heads) a.n_kv_heads = *m.n_kv_heads;
  else if (m.n_heads) a.n_kv_heads = *m.n_heads;
  if (m.vocab_size) a.vocab_size = *m.vocab_size;
  if (m.multiple_of) a.multiple_of = *m.multiple_of;
  if (m.ffn_dim_multiplier) a.ffn_dim_multiplier = *m.ffn_dim_multiplier;
  if (m.norm_eps) a.norm_eps = *m.norm_eps;
  if (m.rope_theta) a.rope_theta = *m.rope_theta;
  if (m.num_experts) a.num_experts = *m.num_experts;
  if (m.top_k) a.top_k = *m.top_k;
  if (m.moe_inter_dim) a.moe_inter_dim = *m.moe_inter_dim;
  if (m.num_shared_experts) a.num_shared_experts = *m.num_shared_experts;
  if (m.n_dense_layers) a.n_dense_layers = *m.n_dense_layers;
  a.score_func = m.score_func;
  if (m.route_norm) a.route_norm = *m.route_norm;
  if (m.route_scale) a.route_scale = *m.route_scale;
  if (m.num_expert_groups) a.num_expert_groups = *m.num_expert_groups;
  if (m.num_limited_groups) a.num_limited_groups = *m.num_limited_groups;
  if (m.load_balance_coeff) a.load_balance_coeff = *m.load_balance_coeff;
  if (m.aux_loss_coeff) a.aux_loss_coeff = *m.aux_loss_coeff;
  a.max_seq_len = c.data.seq_length;
  return a;
}

at::ScalarType resolve_compute_dtype(const Config& config, const c10::Device& device) {
  if (config.runtime.compute_dtype == "float32") return at::kFloat;
  if (config.runtime.compute_dtype == "bfloat16") return at::kBFloat16;
  return device.is_cuda() ? at::kBFloat16 : at::kFloat;  // "auto"
}

Float8Linears resolve_float8(const Config& c) {
  const Float8Config& f = c.float8;
  if (!f.enable_float8_linear) return {};
  return {true, float8_recipe(f.recipe_name), f.emulate, f.filter_fqns, f.enable_fsdp_float8_all_gather};
}

int64_t gemm_tokens(const Config& c) { return c.train.micro_bs * c.data.seq_length / std::max<int64_t>(c.parallel.cp, 1); }

KernelChoices resolve_kernel_choices(const Config& config) {
  return KernelChoices::from(config.runtime.fused_kernels, config.runtime.unfused, config.runtime.varlen_kernel);
}

}  // namespace zb
