#pragma once
// A block's feed-forward, the part after its second norm, behind one interface: the dense SwiGLU
// MLP (DenseSwiGLU) is the first; a mixture of experts takes the same place.
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "kernels/kernel_choices.h"
#include "model_parallel/group.h"

namespace zb {

struct TransformerBlockParams {
  at::Tensor wq, wk, wv, wo;  // attention
  at::Tensor w1, w2, w3;      // the dense SwiGLU's; in a mixture of experts the shared experts' (or none)
  at::Tensor gate;            // a mixture of experts' router [E, D]
  at::Tensor experts_w1, experts_w2, experts_w3;  // and its routed experts, [E, F, D], [E, D, F], [E, F, D]
  at::Tensor attention_norm, ffn_norm;
};

// A mixture of experts' balancing state in one block (model/moe.h), beside its parameters: the
// bias that steers the choice of experts, and the tokens each expert got since the last optimizer
// step. Both [E] on the model's device.
struct ExpertLoad {
  at::Tensor bias;    // fp32, no gradient; changed by update_expert_bias only
  at::Tensor tokens;  // int64: counted by training forwards (not evaluation, not recomputation)
  at::Tensor aux_loss;  // fp32 [1]: the auxiliary losses' sum since the last step (their values, logged)
};

// What the model gives a block's parts to compute with.
struct BlockContext {
  int64_t layer = 0;
  const TransformerBlockParams& params;
  at::ScalarType compute_dtype;
  const KernelChoices& kernels;
  ModelParallelGroup* tp = nullptr;  // null without tensor parallelism
  const ExpertLoad* experts = nullptr;  // a mixture of experts' balancing state (null in a dense block)
  ModelParallelGroup* ep = nullptr;     // expert parallelism's group (null without)
  // x w_i^T for the block's projections `names` ("w1", ..) with `weights`, one input shared:
  // through the projections set from outside the model (FP8) where they take them.
  std::function<std::vector<at::Tensor>(const std::vector<const char*>& names, const at::Tensor& x,
                                        const std::vector<at::Tensor>& weights)>
      project;
  std::function<bool(const char* name)> projected_outside;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // h + ffn(x) at this rank's positions [B, T/tp, D] (all of them without TP), where x is the
  // normed h.
  virtual at::Tensor forward(const BlockContext& block, const at::Tensor& h, const at::Tensor& x) const = 0;
};

// w2(silu(w1 x) * w3 x), no biases. Under TP (model_parallel/tensor_parallel.h) w1 and w3 are
// this rank's columns over the gathered sequence, and w2's partial sums are reduce-scattered back
// to this rank's positions.
class DenseSwiGLU : public FeedForward {
 public:
  at::Tensor forward(const BlockContext& block, const at::Tensor& h, const at::Tensor& x) const override;
};

}  // namespace zb
