#include "model/model_args_json.h"

#include <stdexcept>
#include <string>
#include <type_traits>

namespace zb {
namespace {

// Every key with its member, once; `f(key, member)` both writes and reads through it.
template <class Args, class F>
void for_each_key(Args& a, F&& f) {
  f("dim", a.dim);
  f("n_layers", a.n_layers);
  f("n_heads", a.n_heads);
  f("n_kv_heads", a.n_kv_heads);
  f("vocab_size", a.vocab_size);
  f("multiple_of", a.multiple_of);
  f("ffn_dim_multiplier", a.ffn_dim_multiplier);
  f("norm_eps", a.norm_eps);
  f("rope_theta", a.rope_theta);
  f("max_seq_len", a.max_seq_len);
}

// A mixture of experts' keys: written for such a model only (a dense model's meta.json is as it
// was before experts existed) and read where present (absent: dense).
template <class Args, class F>
void for_each_moe_key(Args& a, F&& f) {
  f("num_experts", a.num_experts);
  f("top_k", a.top_k);
  f("moe_inter_dim", a.moe_inter_dim);
  f("num_shared_experts", a.num_shared_experts);
  f("n_dense_layers", a.n_dense_layers);
  f("score_func", a.score_func);
  f("route_norm", a.route_norm);
  f("route_scale", a.route_scale);
  f("num_expert_groups", a.num_expert_groups);
  f("num_limited_groups", a.num_limited_groups);
  f("load_balance_coeff", a.load_balance_coeff);
  f("aux_loss_coeff", a.aux_loss_coeff);
}

template <class T>
void read_value(const nlohmann::json& value, const char* key, T& member) {
  const bool fits = std::is_same_v<T, std::string> ? value.is_string()
                    : std::is_same_v<T, bool>      ? value.is_boolean()
                                                   : value.is_number();
  if (!fits)
    throw std::runtime_error(std::string("model_args: key '") + key + "' is not " +
                             (std::is_same_v<T, std::string> ? "a string" : std::is_same_v<T, bool> ? "a boolean" : "a number"));
  member = value.get<T>();
}

}  // namespace

nlohmann::json model_args_to_json(const ModelArgs& args) {
  nlohmann::json j = nlohmann::json::object();
  for_each_key(args, [&](const char* key, const auto& value) { j[key] = value; });
  if (args.num_experts > 0) for_each_moe_key(args, [&](const char* key, const auto& value) { j[key] = value; });
  return j;
}

ModelArgs model_args_from_json(const nlohmann::json& j) {
  ModelArgs args;
  for_each_key(args, [&](const char* key, auto& value) {
    const auto it = j.find(key);
    if (it == j.end())
      throw std::runtime_error(std::string("model_args: missing key '") + key + "'");
    read_value(*it, key, value);
  });
  for_each_moe_key(args, [&](const char* key, auto& value) {
    if (const auto it = j.find(key); it != j.end()) read_value(*it, key, value);
  });
  return args;
}

}  // namespace zb
