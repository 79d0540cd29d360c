#include "config/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <variant>

#include "model/model_config.h"

namespace zb {
namespace {

enum class Kind { Bool, Int, Float, String, BoolOrInt };
using Value = std::variant<bool, int64_t, double, std::string>;

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Bool: return "a boolean";
    case Kind::Int: return "an integer";
    case Kind::Float: return "a number";
    case Kind::String: return "a string";
    case Kind::BoolOrInt: return "a boolean or an integer";
  }
  return "?";
}

std::string show(bool v) { return v ? "true" : "false"; }
std::string show(int64_t v) { return std::to_string(v); }
std::string show(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
std::string show(const std::string& v) { return "\"" + v + "\""; }
template <class T>
std::string show(const std::optional<T>& v) {
  return v ? show(*v) : std::string("none");
}

struct Field {
  std::string key;
  Kind kind;
  std::string help;
  std::function<void(Config&, const Value&)> set;
  std::function<std::string(const Config&)> get;
};

// One entry per key. The setter receives a value already checked against `kind`
// (an integer given for a number arrives as a double).
#define ZB_FIELD(KEY, KIND, CPP, MEMBER, HELP)                                         \
  Field {                                                                              \
    KEY, Kind::KIND, HELP, [](Config& c, const Value& v) { c.MEMBER = std::get<CPP>(v); }, \
        [](const Config& c) { return show(c.MEMBER); }                                 \
  }

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      ZB_FIELD("name_model", String, std::string, name_model,
               "model size from the table: debugmodel, 70M, 150M, 271M, 1B, 7B, ... (llama2); "
               "debugmodel, 1B, 8B, ... (llama3)"),
      ZB_FIELD("type_model", String, std::string, type_model, "size table: llama2 | llama3"),
      ZB_FIELD("project", String, std::string, project, "project name, shown in logs and metrics"),
      ZB_FIELD("wandb", Bool, bool, wandb,
               "accepted for ZeroBand configs; ignored (metrics go to logging.metrics_file)"),

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

      ZB_FIELD("train.micro_bs", Int, int64_t, train.micro_bs,
               "sequences per forward/backward on one rank"),
      Field{"train.ac_ckpt", Kind::BoolOrInt,
            "activation checkpointing: false, true (every block) or N (every N-th block)",
            [](Config& c, const Value& v) {
              c.train.ac_ckpt = std::holds_alternative<bool>(v) ? (std::get<bool>(v) ? 1 : 0)
                                                                : std::get<int64_t>(v);
            },
            [](const Config& c) { return c.train.ac_ckpt == 0 ? std::string("false") : show(c.train.ac_ckpt); }},
      ZB_FIELD("train.reshard_after_forward", Bool, bool, train.reshard_after_forward,
               "free gathered block parameters after forward (FSDP)"),
      ZB_FIELD("train.torch_compile", Bool, bool, train.torch_compile,
               "accepted for ZeroBand configs; ignored (no compiler in C++)"),

      ZB_FIELD("train.bucket_mb", Float, double, train.bucket_mb,
               "train_ddp: size of the gradient all-reduce buckets in MiB"),
      ZB_FIELD("optim.sched_type", String, std::string, optim.sched_type,
               "learning-rate schedule: cosine | linear | wsd-sqrt"),
      ZB_FIELD("optim.warmup_steps", Int, int64_t, optim.warmup_steps, "linear warmup steps"),
      ZB_FIELD("optim.stable_steps", Int, int64_t, optim.stable_steps,
               "wsd-sqrt: step where the decay starts"),
      ZB_FIELD("optim.total_steps", Int, int64_t, optim.total_steps, "optimizer steps to run"),
      ZB_FIELD("optim.batch_size", Int, int64_t, optim.batch_size,
               "global batch in sequences per optimizer step"),
      ZB_FIELD("optim.max_norm", Float, double, optim.max_norm,
               "clip gradients to this global L2 norm (0 = no clipping)"),
      ZB_FIELD("optim.optim.type", String, std::string, optim.optim.type,
               "optimizer for the hidden matrices: muon | adamw"),
      ZB_FIELD("optim.optim.lr", Float, double, optim.optim.lr,
               "learning rate of the hidden matrices"),
      ZB_FIELD("optim.optim.wd", Float, double, optim.optim.wd, "decoupled weight decay"),
      ZB_FIELD("optim.optim.momentum", Float, double, optim.optim.momentum, "Muon momentum"),
      ZB_FIELD("optim.optim.ns_steps", Int, int64_t, optim.optim.ns_steps,
               "Muon Newton-Schulz iterations"),
      ZB_FIELD("optim.optim.nesterov", Bool, bool, optim.optim.nesterov,
               "Muon: Nesterov blend of gradient and momentum"),
      ZB_FIELD("optim.optim.update_scale", String, std::string, optim.optim.update_scale,
               "Muon lr scale: original = sqrt(max(1, rows/cols)) | match_rms_adamw = 0.2*sqrt(max(rows, cols))"),
      ZB_FIELD("optim.optim.ns_dtype", String, std::string, optim.optim.ns_dtype,
               "Muon Newton-Schulz precision: bfloat16 | float32"),
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
      ZB_FIELD("runtime.device", String, std::string, runtime.device, "auto | cpu | cuda"),
      ZB_FIELD("runtime.compute_dtype", String, std::string, runtime.compute_dtype,
               "auto (bf16 on cuda, fp32 on cpu) | float32 | bfloat16"),
      ZB_FIELD("runtime.seed", Int, int64_t, runtime.seed, "seed of initialisation and data"),
      ZB_FIELD("runtime.num_threads", Int, int64_t, runtime.num_threads,
               "CPU threads per process (0 = LibTorch's default)"),
      ZB_FIELD("runtime.peak_flops", Float, double, runtime.peak_flops,
               "peak FLOP/s of one device for MFU (0 = from the GPU's name)"),

      ZB_FIELD("runtime.timeout_s", Int, int64_t, runtime.timeout_s,
               "seconds before a rendezvous or collective that is not completing fails"),
      ZB_FIELD("ckpt.path", String, std::string, ckpt.path,
               "directory of checkpoints (\"\" = none)"),
      ZB_FIELD("ckpt.interval", Int, int64_t, ckpt.interval,
               "save every N steps (0 = only at the end and when stopped by SIGTERM/SIGINT)"),
      ZB_FIELD("ckpt.keep", Int, int64_t, ckpt.keep, "newest checkpoints to keep (0 = all)"),
      ZB_FIELD("ckpt.resume", String, std::string, ckpt.resume,
               "resume from a checkpoint directory, or \"latest\" in ckpt.path"),
      ZB_FIELD("ckpt.init_from", String, std::string, ckpt.init_from,
               "initial weights from a Hugging Face model directory (as export_hf writes)"),
      ZB_FIELD("logging.level", String, std::string, logging.level, "debug | info | warn | error"),
      ZB_FIELD("logging.metrics_file", String, std::string, logging.metrics_file,
               "JSON-lines metrics (default outputs/<name_model>-<time>/metrics.jsonl)"),
      ZB_FIELD("logging.interval", Int, int64_t, logging.interval, "console line every N steps"),
  };
  return fields;
}
#undef ZB_FIELD

const std::vector<std::string> kSections = {"model", "train",   "optim",  "optim.optim",
                                            "optim.adam", "data", "runtime", "logging", "ckpt"};

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string did_you_mean(const std::string& key, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = 4;  // only suggest close matches
  for (const auto& c : candidates) {
    size_t d = edit_distance(key, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

const Field* find_field(const std::string& key) {
  for (const auto& f : schema())
    if (f.key == key) return &f;
  return nullptr;
}

ConfigError unknown_key(const std::string& key, const std::string& where) {
  std::vector<std::string> keys;
  for (const auto& f : schema()) keys.push_back(f.key);
  return ConfigError(where + ": unknown key '" + key + "'" + did_you_mean(key, keys));
}

std::string node_where(const std::string& source, const toml::node& node) {
  return source + ":" + std::to_string(node.source().begin.line);
}

Value value_from_toml(const toml::node& node, const Field& f, const std::string& where) {
  switch (f.kind) {
    case Kind::Bool:
      if (auto v = node.value_exact<bool>()) return *v;
      break;
    case Kind::Int:
      if (auto v = node.value_exact<int64_t>()) return *v;
      break;
    case Kind::Float:
      if (node.is_integer()) return static_cast<double>(*node.value_exact<int64_t>());
      if (auto v = node.value_exact<double>()) return *v;
      break;
    case Kind::String:
      if (auto v = node.value_exact<std::string>()) return *v;
      break;
    case Kind::BoolOrInt:
      if (auto v = node.value_exact<bool>()) return *v;
      if (auto v = node.value_exact<int64_t>()) return *v;
      break;
  }
  std::ostringstream got;
  got << node.type();
  throw ConfigError(where + ": key '" + f.key + "' must be " + kind_name(f.kind) + ", got " +
                    got.str());
}

void load_table(const toml::table& table, const std::string& prefix, Config& c) {
  for (auto&& [k, node] : table) {
    const std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    const std::string where = node_where(c.source, node);
    if (const auto* sub = node.as_table()) {
      if (std::find(kSections.begin(), kSections.end(), key) == kSections.end())
        throw ConfigError(where + ": unknown section [" + key + "]" + did_you_mean(key, kSections));
      load_table(*sub, key, c);
      continue;
    }
    const Field* f = find_field(key);
    if (!f) throw unknown_key(key, where);
    f->set(c, value_from_toml(node, *f, where));
    c.origins[key] = where;
  }
}

bool parse_bool(const std::string& s, bool& out) {
  if (s.empty() || s == "true" || s == "True" || s == "1") return out = true, true;
  if (s == "false" || s == "False" || s == "0") return out = false, true;
  return false;
}

bool parse_int(std::string s, int64_t& out) {
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());  // TOML-style 80_000
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}

bool parse_double(std::string s, double& out) {
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) return false;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (*end != '\0' || !std::isfinite(v)) return false;
  out = v;
  return true;
}

}  // namespace

std::string Config::origin(const std::string& key) const {
  auto it = origins.find(key);
  return it != origins.end() ? it->second : source + " (default of " + key + ")";
}

Config load_config_string(const std::string& text, const std::string& source) {
  Config c;
  c.source = source;
  toml::table table;
  try {
    table = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError(source + ":" + std::to_string(e.source().begin.line) +
                      ": not valid TOML: " + std::string(e.description()));
  }
  if (!table.contains("train"))
    throw ConfigError(source + ": missing required section [train]");
  load_table(table, "", c);
  return c;
}

Config load_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot open config file");
  std::stringstream ss;
  ss << in.rdbuf();
  return load_config_string(ss.str(), path);
}

void apply_override(Config& c, const std::string& key, const std::string& text) {
  const std::string where = "command line (--" + key + ")";
  const Field* f = find_field(key);
  if (!f) throw unknown_key(key, "command line");
  Value v;
  bool ok = false;
  switch (f->kind) {
    case Kind::Bool: {
      bool b = false;
      ok = parse_bool(text, b);
      v = b;
      break;
    }
    case Kind::Int: {
      int64_t i = 0;
      ok = parse_int(text, i);
      v = i;
      break;
    }
    case Kind::Float: {
      double d = 0;
      ok = parse_double(text, d);
      v = d;
      break;
    }
    case Kind::String:
      ok = true;
      v = text;
      break;
    case Kind::BoolOrInt: {
      bool b = false;
      int64_t i = 0;
      if (text != "1" && text != "0" && parse_bool(text, b)) ok = true, v = b;
      else if (parse_int(text, i)) ok = true, v = i;
      break;
    }
  }
  if (!ok)
    throw ConfigError(where + ": key '" + key + "' must be " + kind_name(f->kind) + ", got '" +
                      text + "'");
  f->set(c, v);
  c.origins[key] = where;
}

void validate(const Config& c, int64_t world_size) {
  auto fail = [&](const std::string& key, const std::string& msg) {
    throw ConfigError(c.origin(key) + ": " + msg);
  };
  auto one_of = [&](const std::string& key, const std::string& value,
                    const std::vector<std::string>& allowed) {
    if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) return;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : " | ") + a;
    fail(key, key + " = \"" + value + "\" is not one of " + list);
  };
  auto positive = [&](const std::string& key, double value) {
    if (!(value > 0)) fail(key, key + " must be > 0, got " + show(value));
  };
  auto non_negative = [&](const std::string& key, double value) {
    if (!(value >= 0)) fail(key, key + " must be >= 0, got " + show(value));
  };

  if (world_size < 1) throw ConfigError("world size must be >= 1, got " + std::to_string(world_size));

  // Model shapes.
  one_of("type_model", c.type_model, {"llama2", "llama3"});
  const ModelArgs a = resolve_model_args(c);
  positive("model.dim", a.dim);
  positive("model.n_layers", a.n_layers);
  positive("model.n_heads", a.n_heads);
  positive("model.n_kv_heads", a.n_kv_heads);
  positive("model.vocab_size", a.vocab_size);
  positive("model.multiple_of", a.multiple_of);
  positive("model.norm_eps", a.norm_eps);
  positive("model.rope_theta", a.rope_theta);
  if (a.dim % a.n_heads != 0)
    fail("model.n_heads", "n_heads (" + show(a.n_heads) + ") must divide dim (" + show(a.dim) + ")");
  if (a.n_heads % a.n_kv_heads != 0)
    fail("model.n_kv_heads", "n_kv_heads (" + show(a.n_kv_heads) + ") must divide n_heads (" +
                                 show(a.n_heads) + ")");
  if (a.head_dim() % 2 != 0)
    fail("model.dim", "head dimension dim/n_heads = " + show(a.head_dim()) +
                              " must be even for rotary embeddings");

  // Training and batch arithmetic.
  positive("train.micro_bs", c.train.micro_bs);
  non_negative("train.ac_ckpt", c.train.ac_ckpt);
  positive("train.bucket_mb", c.train.bucket_mb);
  positive("optim.batch_size", c.optim.batch_size);
  if (c.optim.batch_size % (world_size * c.train.micro_bs) != 0)
    fail("optim.batch_size", "optim.batch_size (" + show(c.optim.batch_size) +
                                 ") must be divisible by world size (" + show(world_size) +
                                 ") x train.micro_bs (" + show(c.train.micro_bs) + ")");
  positive("data.seq_length", c.data.seq_length);
  non_negative("data.num_workers", c.data.num_workers);
  non_negative("data.eval_interval", c.data.eval_interval);
  positive("data.eval_batches", c.data.eval_batches);
  if (c.data.eval_interval > 0 && !c.data.val_dataset_name_or_paths && !c.data.fake)
    fail("data.eval_interval", "data.eval_interval is set but data.val_dataset_name_or_paths is not");

  // Schedule.
  one_of("optim.sched_type", c.optim.sched_type, {"cosine", "linear", "wsd-sqrt"});
  positive("optim.total_steps", c.optim.total_steps);
  non_negative("optim.warmup_steps", c.optim.warmup_steps);
  if (c.optim.sched_type == "wsd-sqrt" &&
      !(c.optim.warmup_steps <= c.optim.stable_steps && c.optim.stable_steps <= c.optim.total_steps))
    fail("optim.stable_steps", "wsd-sqrt needs warmup_steps (" + show(c.optim.warmup_steps) +
                                   ") <= stable_steps (" + show(c.optim.stable_steps) +
                                   ") <= total_steps (" + show(c.optim.total_steps) + ")");
  non_negative("optim.max_norm", c.optim.max_norm);

  // Optimizer.
  one_of("optim.optim.type", c.optim.optim.type, {"muon", "adamw"});
  positive("optim.optim.lr", c.optim.optim.lr);
  non_negative("optim.optim.wd", c.optim.optim.wd);
  if (!(c.optim.optim.momentum >= 0 && c.optim.optim.momentum < 1))
    fail("optim.optim.momentum", "optim.optim.momentum must be in [0, 1), got " + show(c.optim.optim.momentum));
  positive("optim.optim.ns_steps", c.optim.optim.ns_steps);
  one_of("optim.optim.update_scale", c.optim.optim.update_scale, {"original", "match_rms_adamw"});
  one_of("optim.optim.ns_dtype", c.optim.optim.ns_dtype, {"bfloat16", "float32"});
  non_negative("optim.adam.lr_embedding", c.optim.adam.lr_embedding);
  non_negative("optim.adam.lr_head", c.optim.adam.lr_head);
  non_negative("optim.adam.lr_norm", c.optim.adam.lr_norm);
  for (const char* key : {"optim.adam.betas1", "optim.adam.betas2"}) {
    const double b = std::string(key) == "optim.adam.betas1" ? c.optim.adam.betas1 : c.optim.adam.betas2;
    if (!(b >= 0 && b < 1)) fail(key, std::string(key) + " must be in [0, 1), got " + show(b));
  }
  positive("optim.adam.eps", c.optim.adam.eps);
  non_negative("optim.adam.wd", c.optim.adam.wd);

  // Ours.
  one_of("runtime.device", c.runtime.device, {"auto", "cpu", "cuda"});
  one_of("runtime.compute_dtype", c.runtime.compute_dtype, {"auto", "float32", "bfloat16"});
  non_negative("runtime.num_threads", c.runtime.num_threads);
  non_negative("runtime.peak_flops", c.runtime.peak_flops);
  positive("runtime.timeout_s", c.runtime.timeout_s);
  one_of("logging.level", c.logging.level, {"debug", "info", "warn", "error"});
  non_negative("ckpt.interval", c.ckpt.interval);
  non_negative("ckpt.keep", c.ckpt.keep);
  if (c.ckpt.resume == "latest" && c.ckpt.path.empty())
    fail("ckpt.resume", "ckpt.resume = \"latest\" needs ckpt.path");
  positive("logging.interval", c.logging.interval);
}

std::vector<KeyHelp> config_keys() {
  const Config defaults;
  std::vector<KeyHelp> out;
  for (const auto& f : schema()) {
    std::string type = f.kind == Kind::Bool ? "bool" : f.kind == Kind::Int ? "int"
                     : f.kind == Kind::Float ? "float" : f.kind == Kind::String ? "string"
                     : "bool|int";
    out.push_back({f.key, type, f.get(defaults), f.help});
  }
  return out;
}

int64_t grad_accum_steps(const Config& c, int64_t world_size) {
  return c.optim.batch_size / (world_size * c.train.micro_bs);
}

}  // namespace zb
