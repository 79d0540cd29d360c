#include "optim/optimizer.h"

#include "optim/param_groups.h"
#include "util/log.h"

namespace zb {

at::ScalarType resolve_ns_dtype(const Config& c, const c10::Device& device, std::string* why) {
  const std::string& setting = c.optim.optim.ns_dtype;
  if (setting != "auto") {
    if (why) *why = "optim.optim.ns_dtype = " + setting;
    return setting == "float32" ? at::kFloat : at::kBFloat16;
  }
  if (why) *why = device.is_cuda() ? "auto: bfloat16 on the GPU" : "auto: float32 on the CPU, where bfloat16 products are slow";
  return device.is_cuda() ? at::kBFloat16 : at::kFloat;
}

Optimizer::Optimizer(const Config& c, const std::vector<ShardedParameter>& params, const KernelChoices& kernels) {
  const auto& a = c.optim.adam;
  auto adam = [&](double lr, double wd) {
    AdamWHyper h;
    h.lr = lr;
    h.beta1 = a.betas1;
    h.beta2 = a.betas2;
    h.eps = a.eps;
    h.weight_decay = wd;
    return h;
  };
  for (const auto& group : group_parameters(params)) {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> names;
    int64_t numel = 0;
    for (const auto& p : group.params) {
      tensors.push_back(*p.tensor);
      names.push_back(p.name);
      numel += p.tensor->numel();
    }
    const std::string what = strf("%zu tensors, %ld parameters", tensors.size(), numel);
    if (group.role == ParamRole::Hidden && c.optim.optim.type == "muon") {
      MuonHyper h;
      h.lr = c.optim.optim.lr;
      h.weight_decay = c.optim.optim.wd;
      h.momentum = c.optim.optim.momentum;
      h.nesterov = c.optim.optim.nesterov;
      h.ns_steps = c.optim.optim.ns_steps;
      h.ns_coefficients = c.optim.optim.ns_coefficients;
      h.ns_algorithm = c.optim.optim.ns_algorithm;
      h.update_scale = c.optim.optim.update_scale;
      h.kernels = kernels;
      std::string why;
      h.ns_dtype = resolve_ns_dtype(c, group.params.front().tensor->device(), &why);
      muon_.emplace(h);
      for (const auto& p : group.params) muon_->add_param(p.name, *p.tensor, p.global_shape, p.slice_shape, p.tp_dim);
      descriptions_.push_back(strf("muon: lr %g, wd %g, momentum %g%s, %ld Newton-Schulz steps (%s%s, %s), scale %s; %s",
                                   h.lr, h.weight_decay, h.momentum, h.nesterov ? " nesterov" : "",
                                   h.ns_steps, h.ns_coefficients.c_str(),
                                   h.ns_algorithm == "gram" ? ", Gram where it pays" : "",
                                   (std::string(c10::toString(h.ns_dtype)) + ", " + why).c_str(),
                                   h.update_scale.c_str(),
                                   what.c_str()));
      continue;
    }
    double lr = c.optim.optim.lr, wd = c.optim.optim.wd;  // hidden matrices under AdamW
    if (group.role == ParamRole::Embedding) lr = a.lr_embedding, wd = a.wd;
    if (group.role == ParamRole::Head) lr = a.lr_head, wd = a.wd;
    if (group.role == ParamRole::Norm) lr = a.lr_norm, wd = a.wd;
    adamw_.add_group(role_name(group.role), adam(lr, wd), tensors, names);
    descriptions_.push_back(strf("adamw %s: lr %g, betas (%g, %g), eps %g, wd %g; %s",
                                 role_name(group.role), lr, a.betas1, a.betas2, a.eps, wd, what.c_str()));
  }
}

void Optimizer::step(double lr_multiplier) {
  adamw_.step(lr_multiplier);
  if (muon_) muon_->step(lr_multiplier);
}

std::vector<std::pair<std::string, double>> Optimizer::learning_rates(double lr_multiplier) const {
  std::vector<std::pair<std::string, double>> out;
  if (muon_) out.emplace_back("muon", muon_->hyper().lr * lr_multiplier);
  for (const auto& g : adamw_.groups()) out.emplace_back(g.name, g.hyper.lr * lr_multiplier);
  return out;
}

std::vector<std::string> Optimizer::describe() const { return descriptions_; }

std::vector<OptimizerState> Optimizer::state() const {
  std::vector<OptimizerState> out;
  if (muon_)
    for (const auto& p : muon_->params()) out.push_back({p.name, "momentum_buffer", p.momentum_buffer});
  for (const auto& g : adamw_.groups())
    for (size_t i = 0; i < g.params.size(); ++i) {
      out.push_back({g.param_names[i], "exp_avg", g.exp_avg[i]});
      out.push_back({g.param_names[i], "exp_avg_sq", g.exp_avg_sq[i]});
      out.push_back({g.param_names[i], "step", g.step[i]});
    }
  return out;
}

}  // namespace zb
