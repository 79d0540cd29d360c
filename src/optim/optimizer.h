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
#include "optim/adamw.h"
#include "optim/muon.h"
#include "parallel/parallel_model.h"

namespace zb {

// One tensor of the optimizer's state: `key` of parameter `param` ("momentum_buffer" for Muon;
// "exp_avg", "exp_avg_sq", "step" for AdamW). Shaped like this rank's part of the parameter,
// except AdamW's step, a scalar.
struct OptimizerState {
  std::string param;
  std::string key;
  at::Tensor tensor;
};

// optim.optim.ns_dtype on `device`: "auto" is bf16 on CUDA (its tensor cores multiply bf16 several
// times faster than fp32) and fp32 elsewhere (a CPU without bf16 matrix instructions multiplies
// bf16 about 70 times slower than fp32). The reason, for the start-up line.
at::ScalarType resolve_ns_dtype(const Config& config, const c10::Device& device, std::string* why = nullptr);

class Optimizer {
 public:
  // `params` are this rank's tensors of the parameters (shards or whole), with their global
  // shapes (Muon's update scale and orthogonalisation need the whole matrix's). `kernels`: Muon's
  // (the run's KernelChoices).
  Optimizer(const Config& config, const std::vector<ShardedParameter>& params, const KernelChoices& kernels);

  void step(double lr_multiplier);

  // (group name, lr) at this multiplier: "muon" or "hidden", then "embedding", "head", "norm".
  std::vector<std::pair<std::string, double>> learning_rates(double lr_multiplier) const;
  // One line per group, for the start-up log.
  std::vector<std::string> describe() const;
  // Every state tensor, with the parameter it belongs to (what checkpoints save).
  std::vector<OptimizerState> state() const;

  Muon* muon() { return muon_ ? &*muon_ : nullptr; }
  AdamW& adamw() { return adamw_; }

 private:
  std::optional<Muon> muon_;
  AdamW adamw_;
  std::vector<std::string> descriptions_;
};

}  // namespace zb
