#include "parallel/gradient_group.h"

#include "kernels/fp32_updates.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

namespace zb {

namespace {

struct GradientGroupNode : torch::autograd::Function<GradientGroupNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                GradientGroup* group, at::TensorList leaves) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["n"] = static_cast<int64_t>(leaves.size());
    return group->forward_views();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    reinterpret_cast<GradientGroup*>(ctx->saved_data["group"].toInt())->gradients_ready(grads);
    // Nothing for the group pointer nor, here, for the leaves.
    return torch::autograd::variable_list(static_cast<size_t>(ctx->saved_data["n"].toInt()) + 1);
  }
};

}  // namespace

std::vector<at::Tensor> through_gradient_group(GradientGroup& group, at::TensorList leaves) {
  return GradientGroupNode::apply(&group, leaves);
}

GradientTotals GradientAccumulator::add(const std::vector<at::Tensor>& grads,
                                       const std::vector<std::vector<int64_t>>& shapes, c10::Device device, bool sync) {
  if (sync && sums_.empty()) return {grads, false};  // one micro-batch: nothing to add up
  at::NoGradGuard no_grad;
  if (sums_.empty()) {
    // The first micro-batch's gradients start the sums as fp32 copies (zeros where one is
    // missing): the same values as zeros plus the gradient, in one pass instead of two.
    for (size_t i = 0; i < shapes.size(); ++i) {
      const at::Tensor g = i < grads.size() ? grads[i] : at::Tensor();
      sums_.push_back(g.defined() ? fp32_copy(g.to(device), kernels_)
                                  : at::zeros(shapes[i], at::TensorOptions().device(device)));
    }
  } else {
    for (size_t i = 0; i < sums_.size() && i < grads.size(); ++i)
      if (grads[i].defined()) scale_add_(sums_[i], 1.0, grads[i], 1.0, kernels_);  // sums_[i] += grads[i]
  }
  if (!sync) return {};
  GradientTotals totals{{}, true};
  totals.sums.swap(sums_);  // empty again for the next step
  return totals;
}

void divide_for_mean_over_ranks(at::Tensor& flat, int64_t world_size) {
  flat.div_(static_cast<double>(world_size));
}

}  // namespace zb
