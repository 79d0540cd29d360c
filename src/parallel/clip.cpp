#include "parallel/clip.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

namespace zb {

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                           const std::vector<Communicator*>& sum_over, const std::vector<bool>& counted) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads, summed;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.grad().defined() || p.numel() == 0) continue;
    grads.push_back(p.grad());
    if (counted.empty() || counted[i]) summed.push_back(p.grad());
  }
  const auto device = params.empty() ? c10::Device(c10::kCPU) : params.front().device();
  // One norm per tensor in a single multi-tensor launch; their squares summed (over ranks too).
  at::Tensor sum_sq = at::zeros({1}, at::TensorOptions().device(device));
  if (!summed.empty()) sum_sq += at::stack(at::_foreach_norm(summed, 2)).to(at::kFloat).pow(2).sum();
  for (Communicator* group : sum_over)
    if (group) group->all_reduce_sum(sum_sq).wait();
  at::Tensor total = sum_sq.sqrt().squeeze(0);
  if (max_norm > 0 && !grads.empty()) {
    at::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
    at::_foreach_mul_(grads, coef);
  }
  return total;
}

}  // namespace zb
