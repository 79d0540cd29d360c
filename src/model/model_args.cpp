#include "model/model_args.h"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace zb {

int64_t ModelArgs::ffn_hidden() const {
  int64_t hidden = 2 * (4 * dim) / 3;
  if (ffn_dim_multiplier > 0) hidden = static_cast<int64_t>(ffn_dim_multiplier * hidden);
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

int64_t ModelArgs::moe_layers() const { return num_experts > 0 ? std::max<int64_t>(n_layers - n_dense_layers, 0) : 0; }

namespace {
ModelArgs make(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t multiple_of,
               double multiplier, double theta) {
  ModelArgs a;
  a.dim = dim;
  a.n_layers = layers;
  a.n_heads = heads;
  a.n_kv_heads = kv_heads;
  a.multiple_of = multiple_of;
  a.ffn_dim_multiplier = multiplier;
  a.rope_theta = theta;
  return a;
}

const std::map<std::string, ModelArgs>& table(const std::string& type_model) {
  // ZeroBand's tables (torchtitan's llama configs).
  static const std::map<std::string, ModelArgs> llama2 = {
      {"debugmodel", make(256, 2, 8, 8, 256, 0, 1e4)},
      {"70M", make(512, 6, 8, 8, 256, 0, 1e4)},
      {"150M", make(1024, 12, 16, 16, 256, 0, 1e4)},
      {"271M", make(1024, 16, 8, 8, 256, 0, 1e4)},
      {"1B", make(2048, 18, 16, 16, 256, 0, 1e4)},
      {"7B", make(4096, 32, 32, 32, 256, 0, 1e4)},
      {"10B", make(5120, 32, 40, 40, 256, 0, 1e4)},
      {"13B", make(5120, 40, 40, 40, 256, 0, 1e4)},
      {"26B", make(5120, 80, 40, 40, 256, 0, 1e4)},
      {"70B", make(8192, 80, 64, 8, 4096, 1.3, 1e4)},
  };
  static const std::map<std::string, ModelArgs> llama3 = {
      {"debugmodel", make(256, 8, 16, 16, 256, 0, 5e5)},
      {"1B", make(2048, 18, 16, 8, 512, 1.3, 5e5)},
      {"8B", make(4096, 32, 32, 8, 1024, 1.3, 5e5)},
      {"10B", make(4096, 42, 32, 8, 1024, 1.3, 5e5)},
      {"70B", make(8192, 80, 64, 8, 4096, 1.3, 5e5)},
      {"405B", make(16384, 126, 128, 8, 4096, 1.2, 5e5)},
  };
  if (type_model == "llama2") return llama2;
  if (type_model == "llama3") return llama3;
  throw std::invalid_argument("unknown type_model '" + type_model + "' (known: llama2, llama3)");
}
}  // namespace

std::vector<std::string> known_model_names(const std::string& type_model) {
  std::vector<std::string> names;
  for (const auto& [name, args] : table(type_model)) names.push_back(name);
  return names;
}

ModelArgs lookup_model_args(const std::string& type_model, const std::string& name_model) {
  const auto& t = table(type_model);
  auto it = t.find(name_model);
  if (it == t.end()) {
    std::string known;
    for (const auto& n : known_model_names(type_model)) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown name_model '" + name_model + "' for type_model '" +
                                type_model + "' (known: " + known + ")");
  }
  return it->second;
}

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

TpShare tp_share(const ModelArgs& a, int64_t tp) {
  TpShare s;
  s.kv_shared = a.n_kv_heads % tp != 0;
  s.heads = a.n_heads / tp;
  s.kv_heads = s.kv_shared ? 1 : a.n_kv_heads / tp;
  s.ffn = a.ffn_hidden() / tp;
  s.vocab = a.vocab_size / tp;
  return s;
}

std::vector<ParamSpec> param_specs(const ModelArgs& a, int64_t tp) {
  const int64_t hd = a.head_dim(), hidden = a.ffn_hidden();
  std::vector<ParamSpec> specs;
  const int64_t kv = tp_share(a, tp).kv_shared ? -1 : 0;  // shared key/value heads: whole
  auto add = [&](std::string name, std::vector<int64_t> whole, int64_t layer, int64_t tp_dim) {
    if (tp == 1) tp_dim = -1;
    std::vector<int64_t> shape = whole;
    if (tp_dim >= 0) shape[static_cast<size_t>(tp_dim)] /= tp;
    specs.push_back({std::move(name), std::move(shape), layer, tp_dim, std::move(whole)});
  };
  add("tok_embeddings.weight", {a.vocab_size, a.dim}, -1, 0);
  for (int64_t i = 0; i < a.n_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    add(p + "attention.wq.weight", {a.n_heads * hd, a.dim}, i, 0);
    add(p + "attention.wk.weight", {a.n_kv_heads * hd, a.dim}, i, kv);
    add(p + "attention.wv.weight", {a.n_kv_heads * hd, a.dim}, i, kv);
    add(p + "attention.wo.weight", {a.dim, a.n_heads * hd}, i, 1);
    if (a.moe_layer(i)) {
      // The router's gate, the routed experts' 3-D weights (one [F, D] or [D, F] matrix per
      // expert) and the shared experts as one dense SwiGLU.
      const int64_t E = a.num_experts, F = a.expert_hidden(), shared = a.num_shared_experts * F;
      add(p + "moe.router.gate.weight", {E, a.dim}, i, -1);
      add(p + "moe.experts.w1", {E, F, a.dim}, i, -1);
      add(p + "moe.experts.w2", {E, a.dim, F}, i, -1);
      add(p + "moe.experts.w3", {E, F, a.dim}, i, -1);
      if (shared > 0) {
        add(p + "moe.shared_experts.w1.weight", {shared, a.dim}, i, 0);
        add(p + "moe.shared_experts.w2.weight", {a.dim, shared}, i, 1);
        add(p + "moe.shared_experts.w3.weight", {shared, a.dim}, i, 0);
      }
    } else {
      add(p + "feed_forward.w1.weight", {hidden, a.dim}, i, 0);
      add(p + "feed_forward.w2.weight", {a.dim, hidden}, i, 1);
      add(p + "feed_forward.w3.weight", {hidden, a.dim}, i, 0);
    }
    add(p + "attention_norm.weight", {a.dim}, i, -1);
    add(p + "ffn_norm.weight", {a.dim}, i, -1);
  }
  add("norm.weight", {a.dim}, -1, -1);
  add("output.weight", {a.vocab_size, a.dim}, -1, 0);
  return specs;
}

int64_t count_params(const ModelArgs& a) {
  int64_t n = 0;
  for (const auto& s : param_specs(a)) n += s.numel();
  return n;
}

int64_t count_params_without_embedding(const ModelArgs& a) {
  return count_params(a) - a.vocab_size * a.dim;
}

int64_t count_active_params(const ModelArgs& a) {
  // Each MoE layer's experts that a token does not reach: num_experts - top_k of 3 F D each.
  const int64_t idle = a.moe_layers() * (a.num_experts - a.top_k) * 3 * a.expert_hidden() * a.dim;
  return count_params_without_embedding(a) - idle;
}

double flops_per_token(const ModelArgs& a, int64_t seq_len) {
  // 6 FLOPs per parameter per token (2 forward, 4 backward); attention's two matmuls per layer
  // (scores and weighted values) are 2*2*H*Dh*T forward, times 3 with backward.
  return 6.0 * static_cast<double>(count_active_params(a)) +
         12.0 * static_cast<double>(a.n_layers * a.n_heads * a.head_dim() * seq_len);
}

}  // namespace zb
