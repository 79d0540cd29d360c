#include "checkpoint/hf_export.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "model/model_args_json.h"
#include "util/fs.h"

namespace zb {
namespace {

using json = nlohmann::json;

// Our name -> Hugging Face's.
std::string hf_name(const std::string& ours) {
  static const std::vector<std::pair<std::string, std::string>> parts = {
      {"attention.wq.weight", "self_attn.q_proj.weight"}, {"attention.wk.weight", "self_attn.k_proj.weight"},
      {"attention.wv.weight", "self_attn.v_proj.weight"}, {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"}, {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},   {"attention_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"}};
  if (ours == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (ours == "norm.weight") return "model.norm.weight";
  if (ours == "output.weight") return "lm_head.weight";
  const auto dot = ours.find('.', 7);  // "layers.<i>."
  const std::string rest = ours.substr(dot + 1);
  for (const auto& [a, b] : parts)
    if (rest == a) return "model." + ours.substr(0, dot + 1) + b;
  throw std::runtime_error("no Hugging Face name for " + ours);
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
  const json meta = json::parse(read_file(dir + "/meta.json"));
  if (args) *args = model_args_from_json(meta.at("model_args"));
  TensorMap out;
  for (const auto& [name, shape] : meta.at("shapes").items())
    out[name] = at::zeros(shape.get<std::vector<int64_t>>(), at::kFloat);
  const int64_t world = meta.at("world_size");
  for (int64_t s = 0; s < world; ++s) {
    char stem[32];
    std::snprintf(stem, sizeof stem, "/rank_%05ld", s);
    const json index = json::parse(read_file(dir + stem + ".json"));
    const std::string bytes = read_file(dir + stem + ".bin");
    for (const auto& e : index) {
      const std::string name = e["name"];
      if (name.rfind("model/", 0) != 0) continue;
      at::Tensor& full = out.at(name.substr(6));
      const int64_t rows = e["rows"], start = e["row_start"], numel = e["numel"];
      if (numel == 0) continue;
      at::Tensor flat = full.view({full.size(0), -1}).narrow(0, start, rows);
      std::memcpy(flat.data_ptr<float>(), bytes.data() + e["offset"].get<int64_t>(), numel * sizeof(float));
    }
  }
  return out;
}

void write_hf_model(const std::string& out_dir, const ModelArgs& a, const TensorMap& params) {
  make_directories(out_dir);
  // safetensors: u64 header length, JSON header {name: {dtype, shape, data_offsets}}, the data.
  std::map<std::string, at::Tensor> hf;  // sorted by Hugging Face name: a stable file
  for (const auto& [name, t] : params) {
    int64_t heads = 0;
    at::Tensor w = t.to(at::kFloat).contiguous();
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
  if (!f) throw std::runtime_error("cannot write " + out_dir + "/model.safetensors");

  const json config = {
      {"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
      {"hidden_size", a.dim}, {"intermediate_size", a.ffn_hidden()},
      {"num_hidden_layers", a.n_layers}, {"num_attention_heads", a.n_heads},
      {"num_key_value_heads", a.n_kv_heads}, {"head_dim", a.head_dim()},
      {"vocab_size", a.vocab_size}, {"rms_norm_eps", a.norm_eps}, {"rope_theta", a.rope_theta},
      {"max_position_embeddings", 2 * a.max_seq_len}, {"hidden_act", "silu"},
      {"tie_word_embeddings", false}, {"attention_bias", false}, {"mlp_bias", false},
      {"torch_dtype", "float32"},
      // Ours, to rebuild ModelArgs exactly on import:
      {"zeroband_multiple_of", a.multiple_of}, {"zeroband_ffn_dim_multiplier", a.ffn_dim_multiplier}};
  std::ofstream(out_dir + "/config.json") << config.dump(1) << "\n";
}

TensorMap read_hf_model(const std::string& dir, ModelArgs* out_args) {
  const json c = json::parse(read_file(dir + "/config.json"));
  ModelArgs a;
  a.dim = c.at("hidden_size"), a.n_layers = c.at("num_hidden_layers"), a.n_heads = c.at("num_attention_heads");
  a.n_kv_heads = c.value("num_key_value_heads", a.n_heads), a.vocab_size = c.at("vocab_size");
  a.norm_eps = c.value("rms_norm_eps", 1e-5), a.rope_theta = c.value("rope_theta", 10000.0);
  a.max_seq_len = c.value("max_position_embeddings", 4096) / 2;
  a.multiple_of = c.value("zeroband_multiple_of", 256);
  a.ffn_dim_multiplier = c.value("zeroband_ffn_dim_multiplier", 0.0);
  if (out_args) *out_args = a;

  const std::string bytes = read_file(dir + "/model.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const json header = json::parse(bytes.substr(8, n));
  const char* data = bytes.data() + 8 + n;
  TensorMap by_hf;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    if (e["dtype"] != "F32") throw std::runtime_error(dir + ": " + name + " is not F32");
    at::Tensor t = at::empty(e["shape"].get<std::vector<int64_t>>(), at::kFloat);
    const int64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
    std::memcpy(t.data_ptr<float>(), data + begin, static_cast<size_t>(end - begin));
    by_hf[name] = t;
  }
  TensorMap out;
  for (const auto& spec : param_specs(a)) {
    const auto it = by_hf.find(hf_name(spec.name));
    if (it == by_hf.end()) throw std::runtime_error(dir + ": missing " + hf_name(spec.name));
    if (it->second.sizes().vec() != spec.shape)
      throw std::runtime_error(dir + ": " + it->first + " has the wrong shape");
    int64_t heads = 0;
    out[spec.name] = is_rope_matrix(spec.name, &heads, a) ? rope_rows_from_hf(it->second, heads) : it->second;
  }
  return out;
}

}  // namespace zb
