#include "parallel/expert_balance.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>

#include "util/phase.h"

namespace zb {

ExpertBalance::ExpertBalance(Llama& model, Communicator& ranks) : model_(model), ranks_(ranks) {
  for (int64_t l = 0; l < model.args().n_layers; ++l)
    if (model.args().moe_layer(l)) layers_.push_back(l);
}

std::vector<ExpertBalanceStats> ExpertBalance::step(bool apply, int64_t micro_batches) {
  if (layers_.empty()) return {};
  at::NoGradGuard no_grad;
  Phase phase("zb.expert_balance");
  std::vector<ExpertLoad>& loads = model_.expert_loads();
  // [blocks, E + 1] in float64 (counts exact to 2^53): each block's counts, then its auxiliary loss.
  std::vector<at::Tensor> rows;
  for (int64_t l : layers_)
    rows.push_back(at::cat({loads[l].tokens.to(at::kDouble), loads[l].aux_loss.to(at::kDouble)}));
  at::Tensor summed = at::stack(rows);
  ranks_.all_reduce_sum(summed).wait();
  const int64_t E = model_.args().num_experts;
  const double coeff = model_.args().load_balance_coeff;
  std::vector<at::Tensor> biases;
  for (size_t i = 0; i < layers_.size(); ++i) {
    ExpertLoad& load = loads[layers_[i]];
    if (apply && coeff > 0) update_expert_bias(load.bias, summed[static_cast<int64_t>(i)].narrow(0, 0, E), coeff);
    load.tokens.zero_();
    load.aux_loss.zero_();
    biases.push_back(load.bias);
  }
  // The metrics, from one read of the sums and the biases on the host.
  const at::Tensor host = summed.to(at::kCPU), host_biases = at::stack(biases).to(at::kCPU);
  std::vector<ExpertBalanceStats> stats;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const at::Tensor c = host[static_cast<int64_t>(i)].narrow(0, 0, E);
    const double mean = c.mean().item<double>();
    ExpertBalanceStats s;
    s.layer = layers_[i];
    s.max_load = mean > 0 ? c.max().item<double>() / mean : 0;
    s.min_load = mean > 0 ? c.min().item<double>() / mean : 0;
    s.aux_loss = host[static_cast<int64_t>(i)][E].item<double>() / static_cast<double>(ranks_.size() * micro_batches);
    const at::Tensor bias = host_biases[static_cast<int64_t>(i)];
    s.bias_spread = (bias.max() - bias.min()).item<double>();
    stats.push_back(s);
  }
  return stats;
}

std::vector<StateTensor> ExpertBalance::tensors() {
  std::vector<StateTensor> out;
  for (int64_t l : layers_) {
    const at::Tensor& bias = model_.expert_loads()[l].bias;
    StateTensor t;
    t.name = "moe/layers." + std::to_string(l) + ".expert_bias";
    t.local = bias;
    t.global_shape = bias.sizes().vec();
    t.replicated = true;
    out.push_back(t);
  }
  return out;
}

}  // namespace zb
