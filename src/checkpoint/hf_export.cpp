#include "checkpoint/hf_export.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "model/model_args_json.h"
#include "util/fs.h"
#include "util/log.h"

namespace zb {
namespace {

// Closes a file written through a stream and throws naming it if any write failed (a full disk
// shows up at the last flush, which only the close makes).
void close_written(std::ofstream& f, const std::string& path) {
  f.close();
  if (!f) throw std::runtime_error("cannot write " + path + " (disk full?)");
}

using json = nlohmann::json;

// Our name -> Hugging Face's.
std::string hf_name(const std::string& ours) {
  static const std::vector<std::pair<std::string, std::string>> parts = {
      {"attention.wq.weight", "self_attn.q_proj.weight"}, {"attention.wk.weight", "self_attn.k_proj.weight"},
      {"attention.wv.weight", "self_attn.v_proj.weight"}, {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"}, {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},   {"attention_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"}, {"moe.router.gate.weight", "block_sparse_moe.gate.weight"}};
  if (ours == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (ours == "norm.weight") return "model.norm.weight";
  if (ours == "output.weight") return "lm_head.weight";
  const auto dot = ours.find('.', 7);  // "layers.<i>."
  const std::string rest = ours.substr(dot + 1);
  for (const auto& [a, b] : parts)
    if (rest == a) return "model." + ours.substr(0, dot + 1) + b;
  throw std::runtime_error("no Hugging Face name for " + ours);
}

// A JSON file, or an error naming it.
json read_json(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": not valid JSON (" + e.what() + ")");
  }
}

// config.json's number `key`, or its `fallback` when the key is absent and has one.
template <class T>
T config_number(const json& c, const std::string& key, const std::string& path, std::optional<T> fallback = {}) {
  const auto it = c.find(key);
  if (it == c.end()) {
    if (fallback) return *fallback;
    throw std::runtime_error(path + ": missing key '" + key + "'");
  }
  if (!it->is_number()) throw std::runtime_error(path + ": key '" + key + "' is not a number (" + it->dump() + ")");
  return it->get<T>();
}

std::string shape_text(const std::vector<int64_t>& shape) { return json(shape).dump(); }

// A routed experts' stack ("layers.<i>.moe.experts.w1") is one tensor per expert in Mixtral's
// files: model.layers.<i>.block_sparse_moe.experts.<e>.w1.weight, [F, D] (w2: [D, F]).
bool is_expert_stack(const std::string& name) { return name.find(".moe.experts.w") != std::string::npos; }
std::string hf_expert_name(const std::string& ours, int64_t expert) {
  const auto dot = ours.find('.', 7);  // "layers.<i>."
  return "model." + ours.substr(0, dot + 1) + "block_sparse_moe.experts." + std::to_string(expert) + "." +
         ours.substr(ours.size() - 2) + ".weight";
}

// The one transformers class a mixture of experts exports to is Mixtral's: softmax routing,
// renormalised over the k, every block a mixture, no shared experts, no groups, no bias (its
// router has none). What else would be exported as another model is refused, naming its key.
void check_mixtral(const ModelArgs& a) {
  auto refuse = [](const std::string& what) {
    throw std::runtime_error("this mixture of experts has no transformers class (MixtralForCausalLM is the one we "
                             "export to): " + what);
  };
  if (a.score_func != "softmax") refuse("model.score_func is \"" + a.score_func + "\", Mixtral's is softmax");
  if (!a.route_norm) refuse("model.route_norm is false, Mixtral renormalises its weights");
  if (a.route_scale != 1.0) refuse("model.route_scale is not 1");
  if (a.num_shared_experts > 0) refuse("model.num_shared_experts: Mixtral has no shared experts");
  if (a.n_dense_layers > 0) refuse("model.n_dense_layers: every Mixtral block is a mixture");
  if (a.num_expert_groups > 0) refuse("model.num_expert_groups: Mixtral routes without groups");
  if (a.load_balance_coeff > 0) refuse("model.load_balance_coeff: Mixtral's router has no balancing bias");
}

bool is_rope_matrix(const std::string& name, int64_t* heads, const ModelArgs& a) {
  if (name.find("attention.wq.weight") != std::string::npos) return *heads = a.n_heads, true;
  if (name.find("attention.wk.weight") != std::string::npos) return *heads = a.n_kv_heads, true;
  return false;
}

}  // namespace

at::Tensor rope_rows_to_hf(const at::Tensor& w, int64_t heads) {
  const int64_t hd = w.size(0) / heads;
  // [heads, hd/2 pairs, 2, in] -> [heads, 2, hd/2, in]: evens first, then odds.
  return w.reshape({heads, hd / 2, 2, w.size(1)}).transpose(1, 2).reshape(w.sizes()).contiguous();
}

at::Tensor rope_rows_from_hf(const at::Tensor& w, int64_t heads) {
  const int64_t hd = w.size(0) / heads;
  return w.reshape({heads, 2, hd / 2, w.size(1)}).transpose(1, 2).reshape(w.sizes()).contiguous();
}

TensorMap consolidate_checkpoint(const std::string& dir, ModelArgs* args) {
  const std::string meta_path = dir + "/meta.json";
  if (!path_exists(meta_path)) throw std::runtime_error("checkpoint " + dir + ": not a complete checkpoint (no meta.json)");
  const json meta = read_json(meta_path);
  TensorMap out;
  int64_t world = 0;
  // Under DiLoCo the model is the outer parameters, on which every replica agrees (each
  // replica's inner ones have moved on from them since the last outer step).
  const std::string prefix = meta.contains("diloco") ? "diloco/outer/" : "model/";
  try {
    if (args) *args = model_args_from_json(meta.at("model_args"));
    for (const auto& [name, shape] : meta.at("shapes").items())
      out[name] = at::zeros(shape.get<std::vector<int64_t>>(), at::kFloat);
    world = meta.at("world_size");
  } catch (const std::exception& e) {
    throw std::runtime_error(meta_path + ": " + e.what());
  }
  for (int64_t s = 0; s < world; ++s) {
    char stem[32];
    std::snprintf(stem, sizeof stem, "/rank_%05ld", s);
    const std::string index_path = dir + stem + ".json", bin_path = dir + stem + ".bin";
    const json index = read_json(index_path);
    const std::string bytes = read_file(bin_path);
    for (const auto& e : index) {
      const std::string name = e.value("name", "");
      if (name.rfind(prefix, 0) != 0) continue;
      const auto full_it = out.find(name.substr(prefix.size()));
      if (full_it == out.end()) throw std::runtime_error(index_path + ": " + name + " is not in meta.json's shapes");
      at::Tensor& full = full_it->second;
      const int64_t rows = e.at("rows"), start = e.at("row_start"), numel = e.at("numel"), offset = e.at("offset");
      if (numel == 0) continue;
      at::Tensor flat = full.view({full.size(0), -1});
      // Under tensor parallelism a matrix split by columns is saved as blocks of them.
      const int64_t col_start = e.value("col_start", int64_t{0}), cols = e.value("cols", flat.size(1));
      if (start < 0 || rows < 0 || start + rows > flat.size(0) || col_start < 0 || cols < 0 ||
          col_start + cols > flat.size(1) || numel != rows * cols)
        throw std::runtime_error(strf("%s: %s: rows [%ld, %ld), columns [%ld, %ld) and %ld values do not fit its shape %s",
                                      index_path.c_str(), name.c_str(), start, start + rows, col_start,
                                      col_start + cols, numel, shape_text(full.sizes().vec()).c_str()));
      if (offset < 0 || offset + numel * 4 > static_cast<int64_t>(bytes.size()))
        throw std::runtime_error(strf("%s has %zu bytes, but %s's rows end at byte %ld (truncated?)", bin_path.c_str(),
                                      bytes.size(), name.c_str(), offset + numel * 4));
      const at::Tensor saved = at::from_blob(const_cast<char*>(bytes.data() + offset), {rows, cols}, at::kFloat);
      flat.narrow(0, start, rows).narrow(1, col_start, cols).copy_(saved);
    }
  }
  return out;
}

void write_hf_model(const std::string& out_dir, const ModelArgs& a, const TensorMap& params) {
  make_directories(out_dir);
  // safetensors: u64 header length, JSON header {name: {dtype, shape, data_offsets}}, the data.
  if (a.num_experts > 0) check_mixtral(a);
  std::map<std::string, at::Tensor> hf;  // sorted by Hugging Face name: a stable file
  for (const auto& [name, t] : params) {
    int64_t heads = 0;
    at::Tensor w = t.to(at::kFloat).contiguous();
    if (is_expert_stack(name)) {
      for (int64_t e = 0; e < w.size(0); ++e) hf[hf_expert_name(name, e)] = w[e].contiguous();
      continue;
    }
    hf[hf_name(name)] = is_rope_matrix(name, &heads, a) ? rope_rows_to_hf(w, heads) : w;
  }
  json header = json::object();
  int64_t offset = 0;
  for (const auto& [name, t] : hf) {
    header[name] = {{"dtype", "F32"}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + t.numel() * 4}}};
    offset += t.numel() * 4;
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');  // align the data to 8 bytes
  std::ofstream f(out_dir + "/model.safetensors", std::ios::binary);
  const uint64_t n = head.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(head.data(), static_cast<std::streamsize>(head.size()));
  for (const auto& [name, t] : hf) f.write(static_cast<const char*>(t.data_ptr()), t.numel() * 4);
  close_written(f, out_dir + "/model.safetensors");

  const bool moe = a.num_experts > 0;
  json config = {
      {"architectures", {moe ? "MixtralForCausalLM" : "LlamaForCausalLM"}}, {"model_type", moe ? "mixtral" : "llama"},
      {"hidden_size", a.dim}, {"intermediate_size", moe ? a.expert_hidden() : a.ffn_hidden()},
      {"num_hidden_layers", a.n_layers}, {"num_attention_heads", a.n_heads},
      {"num_key_value_heads", a.n_kv_heads}, {"head_dim", a.head_dim()},
      {"vocab_size", a.vocab_size}, {"rms_norm_eps", a.norm_eps}, {"rope_theta", a.rope_theta},
      {"max_position_embeddings", 2 * a.max_seq_len}, {"hidden_act", "silu"},
      {"tie_word_embeddings", false}, {"attention_bias", false}, {"mlp_bias", false},
      {"torch_dtype", "float32"},
      // Ours, to rebuild ModelArgs exactly on import:
      {"zeroband_multiple_of", a.multiple_of}, {"zeroband_ffn_dim_multiplier", a.ffn_dim_multiplier}};
  if (moe) {  // Mixtral's keys; its auxiliary loss is off unless output_router_logits
    config.update({{"num_local_experts", a.num_experts}, {"num_experts_per_tok", a.top_k},
                   {"router_aux_loss_coef", 0.0}, {"output_router_logits", false}, {"router_jitter_noise", 0.0},
                   {"sliding_window", nullptr}});
    config.erase("attention_bias");
    config.erase("mlp_bias");
  }
  std::ofstream c(out_dir + "/config.json");
  c << config.dump(1) << "\n";
  close_written(c, out_dir + "/config.json");
}

void write_hf_tokenizer(const std::string& tokenizer_json, const std::string& out_dir, int64_t max_length) {
  const std::string text = read_file(tokenizer_json);
  json tokenizer;
  try {
    tokenizer = json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(tokenizer_json + ": not valid JSON (" + e.what() + ")");
  }
  std::ofstream t(out_dir + "/tokenizer.json", std::ios::binary);
  t << text;
  close_written(t, out_dir + "/tokenizer.json");
  // The special tokens, looked for under the names make_shards knows, in its order.
  auto special = [&](std::initializer_list<const char*> names) -> json {
    for (const char* name : names)
      for (const json& t : tokenizer.value("added_tokens", json::array()))
        if (t.value("content", "") == name) return name;
    return nullptr;
  };
  const json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                       {"eos_token", special({"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"})},
                       {"bos_token", special({"<|begin_of_text|>", "<s>", "<bos>"})},
                       {"model_max_length", max_length},
                       {"clean_up_tokenization_spaces", false}};
  std::ofstream f(out_dir + "/tokenizer_config.json");
  f << config.dump(1) << "\n";
  close_written(f, out_dir + "/tokenizer_config.json");
}

TensorMap read_hf_model(const std::string& dir, ModelArgs* out_args) {
  const std::string config_path = dir + "/config.json";
  const json c = read_json(config_path);
  ModelArgs a;
  a.dim = config_number<int64_t>(c, "hidden_size", config_path);
  a.n_layers = config_number<int64_t>(c, "num_hidden_layers", config_path);
  a.n_heads = config_number<int64_t>(c, "num_attention_heads", config_path);
  a.n_kv_heads = config_number<int64_t>(c, "num_key_value_heads", config_path, a.n_heads);
  a.vocab_size = config_number<int64_t>(c, "vocab_size", config_path);
  a.norm_eps = config_number<double>(c, "rms_norm_eps", config_path, 1e-5);
  // transformers 5 keeps RoPE's base under rope_parameters; earlier versions at the top level.
  const json rope = c.value("rope_parameters", json::object());
  a.rope_theta = rope.is_object() && rope.contains("rope_theta")
                     ? config_number<double>(rope, "rope_theta", config_path)
                     : config_number<double>(c, "rope_theta", config_path, 10000.0);
  a.max_seq_len = config_number<int64_t>(c, "max_position_embeddings", config_path, 4096) / 2;
  a.multiple_of = config_number<int64_t>(c, "zeroband_multiple_of", config_path, 256);
  a.ffn_dim_multiplier = config_number<double>(c, "zeroband_ffn_dim_multiplier", config_path, 0.0);
  if (a.dim <= 0 || a.n_layers <= 0 || a.n_heads <= 0 || a.n_kv_heads <= 0 || a.vocab_size <= 0 ||
      a.dim % a.n_heads != 0 || a.n_heads % a.n_kv_heads != 0)
    throw std::runtime_error(config_path + ": sizes that make no model (hidden_size " + std::to_string(a.dim) +
                             ", heads " + std::to_string(a.n_heads) + ", kv heads " + std::to_string(a.n_kv_heads) + ")");
  if (c.value("model_type", "") == "mixtral") {  // every block a mixture, softmax routing renormalised
    a.num_experts = config_number<int64_t>(c, "num_local_experts", config_path);
    a.top_k = config_number<int64_t>(c, "num_experts_per_tok", config_path);
    a.moe_inter_dim = config_number<int64_t>(c, "intermediate_size", config_path);
    a.route_norm = true;
    if (a.num_experts < 1 || a.top_k < 1 || a.top_k > a.num_experts || a.moe_inter_dim < 1)
      throw std::runtime_error(config_path + ": num_local_experts " + std::to_string(a.num_experts) +
                               ", num_experts_per_tok " + std::to_string(a.top_k) + " and intermediate_size " +
                               std::to_string(a.moe_inter_dim) + " make no mixture of experts");
  }
  if (out_args) *out_args = a;

  // safetensors: an 8-byte little-endian header length, the JSON header, then the data; every
  // size is checked against the file before anything is read.
  const std::string path = dir + "/model.safetensors";
  const std::string bytes = read_file(path);
  auto bad = [&](const std::string& what) { return std::runtime_error(path + ": " + what); };
  uint64_t n = 0;
  if (bytes.size() < 8) throw bad(strf("%zu bytes, shorter than the 8-byte header length", bytes.size()));
  std::memcpy(&n, bytes.data(), 8);
  if (n > bytes.size() - 8) throw bad(strf("header length %llu exceeds the file's %zu bytes (truncated or not safetensors)",
                                           static_cast<unsigned long long>(n), bytes.size()));
  json header;
  try {
    header = json::parse(bytes.substr(8, n));
  } catch (const json::exception& e) {
    throw bad(std::string("header is not valid JSON (") + e.what() + ")");
  }
  const char* data = bytes.data() + 8 + n;
  const int64_t data_bytes = static_cast<int64_t>(bytes.size() - 8 - n);
  TensorMap by_hf;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;
    try {
      shape = e.at("shape").get<std::vector<int64_t>>();
      begin = e.at("data_offsets").at(0), end = e.at("data_offsets").at(1);
    } catch (const json::exception& x) {
      throw bad(name + ": malformed entry (" + x.what() + ")");
    }
    if (e.value("dtype", "") != "F32") throw bad(name + " has dtype " + e.value("dtype", "?") + ", expected F32");
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    if (begin < 0 || end < begin || end > data_bytes)
      throw bad(strf("%s: data_offsets [%ld, %ld] outside the file's %ld data bytes (truncated?)", name.c_str(), begin,
                     end, data_bytes));
    if (end - begin != numel * 4)
      throw bad(strf("%s: %ld bytes for shape %s, which needs %ld", name.c_str(), end - begin,
                     shape_text(shape).c_str(), numel * 4));
    at::Tensor t = at::empty(shape, at::kFloat);
    std::memcpy(t.data_ptr<float>(), data + begin, static_cast<size_t>(end - begin));
    by_hf[name] = t;
  }
  TensorMap out;
  for (const auto& spec : param_specs(a)) {
    if (is_expert_stack(spec.name)) {  // one tensor per expert, stacked
      std::vector<at::Tensor> experts;
      for (int64_t e = 0; e < spec.shape[0]; ++e) {
        const std::string name = hf_expert_name(spec.name, e);
        const auto it = by_hf.find(name);
        if (it == by_hf.end()) throw bad("no tensor " + name);
        const std::vector<int64_t> one(spec.shape.begin() + 1, spec.shape.end());
        if (it->second.sizes().vec() != one)
          throw bad(name + " has shape " + shape_text(it->second.sizes().vec()) + ", but config.json's model needs " +
                    shape_text(one));
        experts.push_back(it->second);
      }
      out[spec.name] = at::stack(experts);
      continue;
    }
    const std::string name = hf_name(spec.name);
    const auto it = by_hf.find(name);
    if (it == by_hf.end()) throw bad("no tensor " + name);
    if (it->second.sizes().vec() != spec.shape)
      throw bad(name + " has shape " + shape_text(it->second.sizes().vec()) + ", but config.json's model needs " +
                shape_text(spec.shape));
    int64_t heads = 0;
    out[spec.name] = is_rope_matrix(spec.name, &heads, a) ? rope_rows_from_hf(it->second, heads) : it->second;
  }
  return out;
}

}  // namespace zb
