#pragma once
// DiLoCo's outer optimizer (diloco/diloco.h holds one per fragment of the model). Each
// replica takes inner steps alone; then the pseudo-gradient Δ = θ_outer − θ_inner, averaged over
// the replicas, drives SGD with Nesterov momentum (torch.optim.SGD with nesterov=True, no
// dampening or weight decay) on fp32 outer copies of this rank's tensors, and the result becomes
// every replica's next starting point:
//   b ← μ·b + Δ;   θ_outer ← θ_outer − lr·(Δ + μ·b);   θ_inner ← θ_outer
// DiLoCo's defaults: lr 0.7, μ 0.9. One replica with lr 1 and μ 0 is plain training.
#include <ATen/core/Tensor.h>

#include <vector>

namespace zb {

class OuterNesterov {
 public:
  OuterNesterov(double lr, double momentum);
  // The outer copies start at the inner tensors' values (this rank's shards, any dtype).
  void start_from(const std::vector<at::Tensor>& inner);
  // Δ for each tensor, fp32: what the replicas average (by the caller, over their group).
  std::vector<at::Tensor> pseudo_gradients(const std::vector<at::Tensor>& inner) const;
  // The outer step on the averaged Δ, then the new outer values copied into `inner`.
  void step(const std::vector<at::Tensor>& averaged, const std::vector<at::Tensor>& inner);

  const std::vector<at::Tensor>& outer() const { return outer_; }
  const std::vector<at::Tensor>& momentum_buffers() const { return buffers_; }

 private:
  double lr_, momentum_;
  std::vector<at::Tensor> outer_, buffers_;
};

}  // namespace zb
