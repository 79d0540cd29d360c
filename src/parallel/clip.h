#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

#include "dist/comm.h"

namespace zb {

// Scales the gradients of `params` so that their global L2 norm is at most max_norm (no-op when
// max_norm <= 0) and returns the norm before clipping as a 0-d fp32 tensor. With max_norm > 0 it
// reads the coefficient on the host (one wait for the device) and multiplies only when it is
// below 1; a norm that is not finite leaves the gradients as they are (the step is not applied).
// `sum_over`: when the tensors are disjoint shards of the parameters, the communicators whose
// ranks hold the other shards (their sums of squares are all-reduced over each in turn; null
// entries are skipped); none when `params` hold every element (one process, or replicas with
// identical gradients). `counted`, where given: which tensors add to this rank's sum (one that
// every rank of a group holds alike is counted on one of them); all are clipped.
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                           const std::vector<Communicator*>& sum_over = {}, const std::vector<bool>& counted = {});

}  // namespace zb
