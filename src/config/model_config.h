#pragma once
// From a run's configuration to the model's shapes.
#include "config/config.h"
#include "model/model_args.h"

namespace zb {

// The size table entry for (type_model, name_model), with [model] overrides, the vocabulary and
// the sequence length. Throws ConfigError for unknown names.
ModelArgs resolve_model_args(const Config& config);

}  // namespace zb
