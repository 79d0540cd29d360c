#pragma once
// What the trainer needs from a model spread over ranks, whichever way it is spread: the sharding
// engine (FSDPEngine: each rank holds row shards) or data parallelism (DDPEngine: each rank holds
// everything and gradients are all-reduced).
#include <ATen/core/Tensor.h>

#include <vector>

#include "model/llama.h"

namespace zb {

class ParallelModel {
 public:
  virtual ~ParallelModel() = default;
  virtual at::Tensor forward(const at::Tensor& tokens) = 0;
  // false on micro-batches before the last: gradients accumulate locally, no collective.
  virtual void set_requires_gradient_sync(bool sync) = 0;
  // After each backward: the optimizer's parameters have their (averaged) gradients.
  virtual void finish_backward() = 0;
  // The tensors the optimizer updates, under the model's names, and their whole shapes.
  virtual std::vector<NamedParameter> sharded_parameters() = 0;
  virtual std::vector<std::vector<int64_t>> global_shapes() const = 0;
  virtual std::vector<at::Tensor> sharded_tensors() const = 0;
  // Clips by the global L2 norm; returns the norm before clipping.
  virtual at::Tensor clip_grad_norm_(double max_norm) = 0;
};

}  // namespace zb
