#include "optim/clip.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

namespace zb {

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return at::zeros({}, at::kFloat);
  // One norm per tensor in a single multi-tensor launch, then the norm of those norms.
  at::Tensor total = at::stack(at::_foreach_norm(grads, 2)).to(at::kFloat).norm();
  if (max_norm > 0) {
    at::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
    at::_foreach_mul_(grads, coef);
  }
  return total;
}

}  // namespace zb
