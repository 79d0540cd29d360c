#pragma once
// What the sharding engine (FSDP) and data parallelism (DDP) share on the way from backward to
// the collective that averages gradients over ranks.
//
// A GradientGroup is a set of parameters whose gradients are reduced together: an FSDP unit (one
// block or the root) or a DDP bucket. Its tensors reach the model through one identity autograd
// node, so backward hands the group all of its gradients at once, as soon as the last of them is
// computed, and the group starts its collective while the rest of backward runs.
#include <ATen/core/Tensor.h>
#include <ATen/core/TensorBody.h>

#include <vector>

#include "kernels/kernel_choices.h"

namespace zb {

class GradientGroup {
 public:
  virtual ~GradientGroup() = default;
  // The tensors the model reads in forward (views of the group's parameters' storage).
  virtual std::vector<at::Tensor> forward_views() = 0;
  // Backward reached every view: their gradients (undefined where a view got none).
  virtual void gradients_ready(const std::vector<at::Tensor>& grads) = 0;
};

// group.forward_views(), recorded by autograd as computed from `leaves` (the optimizer's tensors,
// which require grad). The leaves themselves get no gradient from this node: the group fills
// their .grad() after its collective.
std::vector<at::Tensor> through_gradient_group(GradientGroup& group, at::TensorList leaves);

// A step's gradient totals. `owned`: they are the accumulator's own fp32 sums, which nothing else
// holds, so the caller may keep them as they are; else (a single micro-batch) they are the
// gradients backward handed over, which are autograd's.
struct GradientTotals {
  std::vector<at::Tensor> sums;
  bool owned = false;
};

// Gradients summed in fp32 over a step's micro-batches. Before the last micro-batch nothing is
// communicated; on the last (`sync`) the step's totals are handed to the collective.
class GradientAccumulator {
 public:
  // `kernels`: the run's (the model's), whether the sums go through our fp32 update kernel
  // (Fused::Update).
  explicit GradientAccumulator(const KernelChoices& kernels) : kernels_(kernels) {}

  // Adds this micro-batch's gradients (`shapes` and `device` size the sums; a missing gradient
  // counts as zero). Returns the step's totals when `sync`, none before. With a single
  // micro-batch the gradients are returned as they are.
  GradientTotals add(const std::vector<at::Tensor>& grads, const std::vector<std::vector<int64_t>>& shapes,
                     c10::Device device, bool sync);

 private:
  KernelChoices kernels_;
  std::vector<at::Tensor> sums_;
};

// Every rank's loss is the mean over its own samples; the global mean is their average. The
// collective sums (Gloo has no average), so each rank divides its contribution by the world size
// first, in place.
void divide_for_mean_over_ranks(at::Tensor& flat, int64_t world_size);

}  // namespace zb
