#pragma once
// AdamW over many tensors at once: bias-corrected moments, decoupled weight decay
// (p *= 1 - lr*wd, then p -= lr * m_hat / (sqrt(v_hat) + eps)). One fused ATen call per group
// (_fused_adamw_, on CPU and CUDA), so the step is not a storm of per-tensor launches.
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace zb {

struct AdamWHyper {
  double lr = 1e-3;  // base lr; the schedule multiplies it
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class AdamW {
 public:
  struct Group {
    std::string name;
    AdamWHyper hyper;
    std::vector<std::string> param_names;
    std::vector<at::Tensor> params;  // updated in place; their .grad() is the gradient
    // State, named like torch.optim.AdamW's: one tensor per parameter.
    std::vector<at::Tensor> exp_avg, exp_avg_sq;
    std::vector<at::Tensor> step;  // fp32 scalar tensors (what the fused kernel reads)
  };

  void add_group(const std::string& name, const AdamWHyper& hyper, std::vector<at::Tensor> params,
                 std::vector<std::string> param_names = {});
  // One step of every group at lr = base lr * lr_multiplier. Parameters without a gradient are
  // skipped.
  void step(double lr_multiplier);

  std::vector<Group>& groups() { return groups_; }
  const std::vector<Group>& groups() const { return groups_; }

 private:
  std::vector<Group> groups_;
};

}  // namespace zb
