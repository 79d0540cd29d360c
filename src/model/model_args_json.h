#pragma once
// ModelArgs as JSON: the "model_args" object of a checkpoint's meta.json, written and read here
// only, so that the two sides cannot disagree on a key.
#include <nlohmann/json.hpp>

#include "model/model_args.h"

namespace zb {

nlohmann::json model_args_to_json(const ModelArgs& args);
// Throws std::runtime_error naming a key that is missing or not a number.
ModelArgs model_args_from_json(const nlohmann::json& j);

}  // namespace zb
