// Reading keys into a Config: from TOML files and from --dotted.key overrides, with errors that
// name the key, where it came from and the nearest known key. What the keys are is schema.cpp's.
#include "config/fields.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace zb {

// --- Showing values ----------------------------------------------------------------------------

std::string show(bool v) { return v ? "true" : "false"; }
std::string show(int64_t v) { return std::to_string(v); }
std::string show(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
std::string show(const std::string& v) { return "\"" + v + "\""; }
std::string show(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + show(s);
  return "[" + out + "]";
}

std::string join_choices(const std::vector<std::string>& choices) {
  std::string out;
  for (const auto& c : choices) out += (out.empty() ? "" : " | ") + c;
  return out;
}

namespace {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Bool: return "a boolean";
    case Kind::Int: return "an integer";
    case Kind::Float: return "a number";
    case Kind::String: return "a string";
    case Kind::BoolOrInt: return "a boolean or an integer";
    case Kind::BoolOrAuto: return "a boolean or \"auto\"";
    case Kind::StringList: return "a list of strings";
  }
  return "?";
}

// --- Unknown keys: suggest the nearest known one -----------------------------------------------

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

ConfigError unknown_key(const std::string& key, const std::string& where) {
  std::vector<std::string> keys;
  for (const auto& f : schema()) keys.push_back(f.key);
  return ConfigError(where + ": unknown key '" + key + "'" + did_you_mean(key, keys));
}

// --- Values from a TOML file -------------------------------------------------------------------

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
    case Kind::BoolOrAuto:
      if (auto v = node.value_exact<bool>()) return *v;
      if (auto v = node.value_exact<std::string>(); v && *v == "auto") return *v;
      break;
    case Kind::StringList:
      if (const auto* array = node.as_array()) {
        std::vector<std::string> out;
        for (const auto& item : *array) {
          const auto v = item.value_exact<std::string>();
          if (!v) throw ConfigError(where + ": key '" + f.key + "' must be a list of strings");
          out.push_back(*v);
        }
        return out;
      }
      break;
  }
  std::ostringstream got;
  got << node.type();
  throw ConfigError(where + ": key '" + f.key + "' must be " + kind_name(f.kind) + ", got " +
                    got.str());
}

// Every value goes in through here, whatever its source: a number must be finite (TOML has inf
// and nan literals, and strtod reads them), since a NaN learning rate trains on garbage.
void set_value(Config& c, const Field& f, const Value& v, const std::string& where) {
  if (const double* d = std::get_if<double>(&v); d && !std::isfinite(*d))
    throw ConfigError(where + ": key '" + f.key + "' must be a finite number, got " + show(*d));
  f.set(c, v);
  c.origins[f.key] = where;
}

void load_table(const toml::table& table, const std::string& prefix, Config& c) {
  const auto& sections = schema_sections();
  for (auto&& [k, node] : table) {
    const std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    const std::string where = node_where(c.source, node);
    if (const auto* sub = node.as_table()) {
      if (std::find(sections.begin(), sections.end(), key) == sections.end())
        throw ConfigError(where + ": unknown section [" + key + "]" + did_you_mean(key, sections));
      load_table(*sub, key, c);
      continue;
    }
    const Field* f = find_field(key);
    if (!f) throw unknown_key(key, where);
    set_value(c, *f, value_from_toml(node, *f, where), where);
  }
}

// --- Values from command-line text -------------------------------------------------------------

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
  if (*end != '\0') return false;
  out = v;
  return true;
}

// The value of `text` for field `f`, or nothing when it is not of f's kind.
std::optional<Value> value_from_text(const Field& f, const std::string& text) {
  switch (f.kind) {
    case Kind::Bool:
      if (bool b = false; parse_bool(text, b)) return b;
      break;
    case Kind::Int:
      if (int64_t i = 0; parse_int(text, i)) return i;
      break;
    case Kind::Float:
      if (double d = 0; parse_double(text, d)) return d;
      break;
    case Kind::String:
      return text;
    case Kind::BoolOrInt: {
      // "1" and "0" are the integers (every block / off), not booleans.
      bool b = false;
      int64_t i = 0;
      if (text != "1" && text != "0" && parse_bool(text, b)) return b;
      if (parse_int(text, i)) return i;
      break;
    }
    case Kind::BoolOrAuto:
      if (text == "auto") return text;
      if (bool b = false; parse_bool(text, b)) return b;
      break;
    case Kind::StringList: {  // "a,b" or "a, b"; "" is the empty list
      std::vector<std::string> out;
      std::stringstream in(text);
      for (std::string item; std::getline(in, item, ',');) {
        item.erase(0, item.find_first_not_of(' '));
        item.erase(item.find_last_not_of(' ') + 1);
        if (!item.empty()) out.push_back(item);
      }
      return out;
    }
  }
  return std::nullopt;
}

}  // namespace

const Field* find_field(const std::string& key) {
  for (const auto& f : schema())
    if (f.key == key) return &f;
  return nullptr;
}

// --- config.h ----------------------------------------------------------------------------------

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
  const std::optional<Value> v = value_from_text(*f, text);
  if (!v)
    throw ConfigError(where + ": key '" + key + "' must be " + kind_name(f->kind) + ", got '" +
                      text + "'");
  set_value(c, *f, *v, where);
}

std::vector<KeyHelp> config_keys() {
  const Config defaults;
  std::vector<KeyHelp> out;
  for (const auto& f : schema()) {
    std::string type = !f.choices.empty() ? "one of " + join_choices(f.choices)
                     : f.kind == Kind::Bool ? "bool" : f.kind == Kind::Int ? "int"
                     : f.kind == Kind::Float ? "float" : f.kind == Kind::String ? "string"
                     : f.kind == Kind::BoolOrAuto ? "bool|\"auto\"" : f.kind == Kind::StringList ? "list of strings"
                     : "bool|int";
    out.push_back({f.key, type, f.get(defaults), f.help});
  }
  return out;
}

}  // namespace zb
