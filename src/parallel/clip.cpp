#include "parallel/clip.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

namespace zb {

namespace {
// ATen's CPU norm kernel sums in fp32 accumulators (per thread and vector lane), so its relative
// error grows with a tensor's length (4e-4 at 10 million elements, 2e-3 at 33 million: the 150M
// model's embedding), and a norm would depend on how the tensors are split over ranks. On the CPU
// each gradient is normed in blocks of rows of about kCpuNormSlice elements (any strides), whose
// squares add in float64: equal to ~1e-7 however split. CUDA's tree reductions need no blocks.
constexpr int64_t kCpuNormSlice = int64_t{1} << 14;

std::vector<at::Tensor> norm_pieces(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& t : tensors) {
    if (!t.is_cpu() || t.numel() <= kCpuNormSlice) {
      pieces.push_back(t);
      continue;
    }
    const int64_t rows = t.size(0), per_row = t.numel() / rows;
    const int64_t step = std::max<int64_t>(1, kCpuNormSlice / per_row);
    for (int64_t start = 0; start < rows; start += step)
      pieces.push_back(t.narrow(0, start, std::min(step, rows - start)));
  }
  return pieces;
}
}  // namespace

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                           const std::vector<Communicator*>& sum_over, const std::vector<bool>& counted) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads, summed;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.grad().defined() || p.numel() == 0) continue;
    grads.push_back(p.grad());
    if (counted.empty() || counted[i]) summed.push_back(p.grad());
  }
  const auto device = params.empty() ? c10::Device(c10::kCPU) : params.front().device();
  // One norm per tensor (or CPU slice) in a single multi-tensor launch; their squares summed in
  // float64, then over the ranks in fp32.
  at::Tensor sum_sq = at::zeros({1}, at::TensorOptions().device(device));
  if (!summed.empty())
    sum_sq += at::stack(at::_foreach_norm(norm_pieces(summed), 2)).to(at::kDouble).pow(2).sum().to(at::kFloat);
  for (Communicator* group : sum_over)
    if (group) group->all_reduce_sum(sum_sq).wait();
  at::Tensor total = sum_sq.sqrt().squeeze(0);
  if (max_norm > 0 && !grads.empty()) {
    const at::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
    // Multiplying by a coefficient of 1 changes nothing: skipped (a pass over every gradient, 3.1 ms
    // of a 1B step on an H100). Reading it waits for the device, as the trainer's read of the norm
    // right after does anyway. Not finite: the gradients are not used (the step is skipped).
    if (coef.item<float>() < 1.0f) at::_foreach_mul_(grads, coef);
  }
  return total;
}

}  // namespace zb
