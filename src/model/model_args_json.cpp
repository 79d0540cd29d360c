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

}  // namespace

nlohmann::json model_args_to_json(const ModelArgs& args) {
  nlohmann::json j = nlohmann::json::object();
  for_each_key(args, [&](const char* key, const auto& value) { j[key] = value; });
  return j;
}

ModelArgs model_args_from_json(const nlohmann::json& j) {
  ModelArgs args;
  for_each_key(args, [&](const char* key, auto& value) {
    const auto it = j.find(key);
    if (it == j.end())
      throw std::runtime_error(std::string("model_args: missing key '") + key + "'");
    if (!it->is_number())
      throw std::runtime_error(std::string("model_args: key '") + key + "' is not a number");
    value = it->get<std::remove_reference_t<decltype(value)>>();
  });
  return args;
}

}  // namespace zb
