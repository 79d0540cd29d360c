#pragma once
// What a checkpoint holds, gathered from the components that own it: the parallel engine's
// parameters (as this rank holds them: shards or replicas), the optimizer's state for each
// parameter, and the data loader's position. Checkpoints depend on this, not on the engines.
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "parallel/parallel_model.h"

namespace zb {

// One tensor of the training state as this rank holds it.
struct StateTensor {
  std::string name;                   // "model/<param>" or "optim/<param>.<key>"
  at::Tensor local;                   // rows [row_start, row_start + local.size(0)) of the whole
  std::vector<int64_t> global_shape;  // empty: a scalar (AdamW's step), the same on every rank
  int64_t row_start = 0;
  bool replicated = false;            // every rank holds the same rows
};

// Every tensor of the training state, parameters first, in a fixed order. An optimizer state
// tensor sits where its parameter does.
std::vector<StateTensor> training_state(ParallelModel& parallel, const Optimizer& optimizer);

}  // namespace zb
