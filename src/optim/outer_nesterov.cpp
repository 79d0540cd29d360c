#include "optim/outer_nesterov.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros_like.h>

namespace zb {

OuterNesterov::OuterNesterov(double lr, double momentum) : lr_(lr), momentum_(momentum) {}

void OuterNesterov::start_from(const std::vector<at::Tensor>& inner) {
  at::NoGradGuard no_grad;
  outer_.clear();
  buffers_.clear();
  for (const at::Tensor& t : inner) {
    outer_.push_back(t.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
    buffers_.push_back(at::zeros_like(outer_.back()));
  }
}

std::vector<at::Tensor> OuterNesterov::pseudo_gradients(const std::vector<at::Tensor>& inner) const {
  at::NoGradGuard no_grad;
  TORCH_CHECK(inner.size() == outer_.size(), "OuterNesterov: ", inner.size(), " tensors, started with ", outer_.size());
  std::vector<at::Tensor> deltas;
  for (size_t i = 0; i < inner.size(); ++i) deltas.push_back(outer_[i] - inner[i].detach().to(at::kFloat));
  return deltas;
}

void OuterNesterov::step(const std::vector<at::Tensor>& averaged, const std::vector<at::Tensor>& inner) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(averaged.size() == outer_.size() && inner.size() == outer_.size(), "OuterNesterov: tensor counts differ");
  for (size_t i = 0; i < outer_.size(); ++i) {
    const at::Tensor& delta = averaged[i];
    buffers_[i].mul_(momentum_).add_(delta);
    outer_[i].sub_(delta + buffers_[i] * momentum_, lr_);
    inner[i].copy_(outer_[i]);
  }
}

}  // namespace zb
