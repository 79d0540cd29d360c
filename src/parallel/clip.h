#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

#include "dist/comm.h"

namespace zb {

// Scales the gradients of `params` so that their global L2 norm is at most max_norm (no-op when
// max_norm <= 0) and returns the norm before clipping as a 0-d fp32 tensor (no host sync).
// `sum_over`: when the tensors are disjoint shards of the parameters, the communicator whose
// ranks hold the other shards (their sums of squares are all-reduced); null when `params` hold
// every element (one process, or replicas with identical gradients).
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                           Communicator* sum_over = nullptr);

}  // namespace zb
