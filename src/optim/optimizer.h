#pragma once
// The training optimizer: Muon for the hidden matrices and AdamW for the embedding, head and norms
// (ZeroBand's split), or AdamW for everything when optim.optim.type = "adamw". One schedule
// multiplier scales every group's base lr.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "model/llama.h"
#include "optim/adamw.h"
#include "optim/muon.h"

namespace zb {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

class Optimizer {
 public:
  // `global_shapes[i]` is the whole-matrix shape of params[i] when params are shards (empty: the
  // tensors are whole).
  Optimizer(const Config& config, const std::vector<NamedParameter>& params,
            const std::vector<std::vector<int64_t>>& global_shapes = {});

  void step(double lr_multiplier);

  // (group name, lr) at this multiplier: "muon" or "hidden", then "embedding", "head", "norm".
  std::vector<std::pair<std::string, double>> learning_rates(double lr_multiplier) const;
  // One line per group, for the start-up log.
  std::vector<std::string> describe() const;
  // Every state tensor by name: "<param>.momentum_buffer", "<param>.exp_avg", "<param>.exp_avg_sq",
  // "<param>.step".
  std::vector<NamedTensor> state() const;

  Muon* muon() { return muon_ ? &*muon_ : nullptr; }
  AdamW& adamw() { return adamw_; }

 private:
  std::optional<Muon> muon_;
  AdamW adamw_;
  std::vector<std::string> descriptions_;
};

}  // namespace zb
