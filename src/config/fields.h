#pragma once
// The machinery behind config.h, private to src/config: a Field describes one dotted key (its
// kind, help, allowed values and how to set and show it in a Config); schema.cpp lists them all,
// and loading, overrides, --help and validation only ever read that list.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "config/config.h"

namespace zb {

enum class Kind { Bool, Int, Float, String, BoolOrInt, BoolOrAuto, StringList };  // BoolOrAuto: true, false or "auto"
// StringList: a TOML array of strings, or on the command line one string of comma-separated names.
// A value already checked against its field's Kind (an integer given for a number arrives as a
// double).
using Value = std::variant<bool, int64_t, double, std::string, std::vector<std::string>>;

struct Field {
  std::string key;  // dotted: "optim.optim.lr"
  Kind kind;
  std::string help;
  std::vector<std::string> choices;  // a String field's allowed values; empty = anything
  std::function<void(Config&, const Value&)> set;
  std::function<std::string(const Config&)> get;  // the value as show() writes it
};

// Every key, in --help order (schema.cpp).
const std::vector<Field>& schema();
// The [sections] a file may have (schema.cpp).
const std::vector<std::string>& schema_sections();

// The field of a dotted key, or nullptr.
const Field* find_field(const std::string& key);

// Values as messages and --help print them: strings quoted, an unset optional as none.
std::string show(bool v);
std::string show(int64_t v);
std::string show(double v);
std::string show(const std::string& v);
std::string show(const std::vector<std::string>& v);  // ["a", "b"]
template <class T>
std::string show(const std::optional<T>& v) {
  return v ? show(*v) : std::string("none");
}

// "a | b | c": how both --help and validation's "is not one of" write a field's choices.
std::string join_choices(const std::vector<std::string>& choices);

}  // namespace zb
