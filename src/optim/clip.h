#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace zb {

// Scales the gradients of `params` so that their global L2 norm is at most max_norm (no-op when
// max_norm <= 0) and returns the norm before clipping as a 0-d fp32 tensor (no host sync).
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace zb
