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
  at::Tensor w1, w2, w3;      // feed_forward (the dense SwiGLU's)
  at::Tensor attention_norm, ffn_norm;
};

// What the model gives a block's parts to compute with.
struct BlockContext {
  int64_t layer = 0;
  const TransformerBlockParams& params;
  at::ScalarType compute_dtype;
  const KernelChoices& kernels;
  ModelParallelGroup* tp = nullptr;  // null without tensor parallelism
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
