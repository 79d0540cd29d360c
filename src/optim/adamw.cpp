#include "optim/adamw.h"
#include "util/phase.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

namespace zb {

void AdamW::add_group(const std::string& name, const AdamWHyper& hyper,
                      std::vector<at::Tensor> params, std::vector<std::string> param_names) {
  Group g;
  if (param_names.empty())
    for (size_t i = 0; i < params.size(); ++i) param_names.push_back(name + "." + std::to_string(i));
  g.param_names = std::move(param_names);
  g.name = name;
  g.hyper = hyper;
  for (const auto& p : params) {
    g.exp_avg.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    g.exp_avg_sq.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    g.step.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
  }
  g.params = std::move(params);
  groups_.push_back(std::move(g));
}

void AdamW::step(double lr_multiplier) {
  Phase phase("zb.adamw");
  at::NoGradGuard no_grad;
  for (auto& g : groups_) {
    std::vector<at::Tensor> params, grads, m, v, steps;
    for (size_t i = 0; i < g.params.size(); ++i) {
      const at::Tensor& grad = g.params[i].grad();
      if (!grad.defined()) continue;
      params.push_back(g.params[i]);
      grads.push_back(grad);
      m.push_back(g.exp_avg[i]);
      v.push_back(g.exp_avg_sq[i]);
      steps.push_back(g.step[i]);
    }
    if (params.empty()) continue;
    const auto& h = g.hyper;
    // The fused kernel reads the step counts for the bias corrections but does not advance them.
    at::_foreach_add_(steps, 1.0);
    at::_fused_adamw_(params, grads, m, v, /*max_exp_avg_sqs=*/{}, steps, h.lr * lr_multiplier,
                      h.beta1, h.beta2, h.weight_decay, h.eps, /*amsgrad=*/false,
                      /*maximize=*/false);
  }
}

}  // namespace zb
