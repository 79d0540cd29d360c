#pragma once
// The fp32 tensors a step keeps updated from its values: the gradient sums over micro-batches,
// Muon's momentum, the master weights. On a GPU our kernels do each in one pass
// (kernels/fp32_update_kernel.cu; runtime.unfused "update" and "momentum" leave them to ATen),
// elsewhere ATen's operators: the same numbers, but for the rounding of a fused multiply-add
// (where alpha is not 1).
#include <ATen/core/Tensor.h>

#include <vector>

#include "kernels/kernel_choices.h"

namespace zb {

// dst = dst * keep + alpha * src in place: dst fp32, src of as many values in any float dtype
// (keep 1: ATen's dst.add_(src, alpha); the multiply by keep, weight decay, rounds on its own).
void scale_add_(const at::Tensor& dst, double keep, const at::Tensor& src, double alpha,
                const KernelChoices& kernels = {});

// src's values as a new contiguous fp32 tensor on src's device (a gradient sum's start).
at::Tensor fp32_copy(const at::Tensor& src, const KernelChoices& kernels = {});

// Muon's momentum over lists of fp32 tensors: each buf = lerp(buf, g, 1 - mu) in place; returns,
// with nesterov, new tensors lerp(g, buf, mu) (buf's new values), else bufs.
std::vector<at::Tensor> momentum_(const std::vector<at::Tensor>& bufs, const std::vector<at::Tensor>& grads,
                                  double mu, bool nesterov, const KernelChoices& kernels = {});

}  // namespace zb
