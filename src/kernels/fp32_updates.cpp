#include "kernels/fp32_updates.h"

#ifdef ZB_WITH_CUDA
#include "kernels/cuda_ops.h"
#endif

#include <ATen/ops/_foreach_lerp.h>
#include <ATen/ops/empty.h>

namespace zb {

void scale_add_(const at::Tensor& dst, double keep, const at::Tensor& src, double alpha,
                const KernelChoices& kernels) {
#ifdef ZB_WITH_CUDA
  if (kernels.kernel_takes(Fused::Update, dst.device()) && scale_add_cuda_applies(dst, src)) {
    // The floats ATen's scalars become (its opmath for fp32).
    scale_add_cuda_(dst, static_cast<float>(keep), src, static_cast<float>(alpha), /*read=*/true);
    return;
  }
#endif
  at::Tensor d = dst;  // a handle: the in-place operators change dst's storage
  if (keep != 1.0) d.mul_(keep);
  d.add_(src, alpha);
}

at::Tensor fp32_copy(const at::Tensor& src, const KernelChoices& kernels) {
#ifdef ZB_WITH_CUDA
  if (kernels.kernel_takes(Fused::Update, src.device()) && src.is_contiguous()) {
    at::Tensor out = at::empty(src.sizes(), src.options().dtype(at::kFloat));
    if (scale_add_cuda_applies(out, src)) {
      scale_add_cuda_(out, 0.0f, src, 1.0f, /*read=*/false);
      return out;
    }
  }
#endif
  return src.to(src.options().dtype(at::kFloat), /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
}

std::vector<at::Tensor> momentum_(const std::vector<at::Tensor>& bufs, const std::vector<at::Tensor>& grads,
                                  double mu, bool nesterov, const KernelChoices& kernels) {
  std::vector<at::Tensor> out(bufs.size());
  std::vector<size_t> rest;  // those the kernel does not take, for ATen's lists
#ifdef ZB_WITH_CUDA
  for (size_t i = 0; i < bufs.size(); ++i) {
    if (!(kernels.kernel_takes(Fused::Momentum, bufs[i].device()) && momentum_cuda_applies(bufs[i], grads[i]))) {
      rest.push_back(i);
      continue;
    }
    out[i] = nesterov ? at::empty(bufs[i].sizes(), bufs[i].options()) : bufs[i];
    momentum_cuda_(bufs[i], grads[i], nesterov ? out[i] : at::Tensor(), static_cast<float>(1.0 - mu),
                   static_cast<float>(mu));
  }
#else
  for (size_t i = 0; i < bufs.size(); ++i) rest.push_back(i);
#endif
  if (rest.empty()) return out;
  std::vector<at::Tensor> b, g;
  for (size_t i : rest) {
    b.push_back(bufs[i]);
    g.push_back(grads[i]);
  }
  at::_foreach_lerp_(b, g, 1.0 - mu);  // EMA momentum
  const std::vector<at::Tensor> n = nesterov ? at::_foreach_lerp(g, b, mu) : b;
  for (size_t j = 0; j < rest.size(); ++j) out[rest[j]] = n[j];
  return out;
}

}  // namespace zb
