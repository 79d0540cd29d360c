#include "model/rope_cuda.h"
#include "model/rope_kernel.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/view_as_real.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <stdexcept>

namespace zb {

namespace {

// x rotated by the table (or its conjugate) into a new contiguous tensor, on x's device and stream.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cis_pairs, bool conjugate) {
  at::Tensor in = x.contiguous();
  if (in.storage_offset() % 2 != 0) in = in.clone();  // pairs read as 4-byte words
  at::Tensor out = at::empty_like(in);
  const c10::cuda::CUDAGuard guard(in.device());
  C10_CUDA_CHECK(launch_rope_bf16(in.const_data_ptr(), out.mutable_data_ptr(), cis_pairs.const_data_ptr(),
                                  in.size(0) * in.size(1), in.size(1), static_cast<int>(in.size(2)),
                                  static_cast<int>(in.size(3) / 2), conjugate,
                                  c10::cuda::getCurrentCUDAStream(in.device().index()).stream()));
  return out;
}

// Autograd: the rotation is linear in x, so backward rotates the gradient by the conjugate (itself
// through this function, so that a second derivative exists) and saves nothing but the table.
struct RopeBf16 : torch::autograd::Function<RopeBf16> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cis_pairs,
                            bool conjugate) {
    ctx->saved_data["cis"] = cis_pairs;
    ctx->saved_data["conjugate"] = conjugate;
    return rotate(x, cis_pairs, conjugate);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor cis = ctx->saved_data["cis"].toTensor();
    return {RopeBf16::apply(grads[0], cis, !ctx->saved_data["conjugate"].toBool()), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool rope_cuda_bf16_applies(const at::Tensor& x, const at::Tensor& cis) {
  if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || x.dim() != 4 || x.size(3) % 2 != 0 ||
      cis.scalar_type() != at::kComplexFloat || cis.device() != x.device() || cis.dim() != 2 ||
      cis.size(0) < x.size(1) || 2 * cis.size(1) != x.size(3) || x.size(2) * x.size(3) / 2 > (1 << 30))
    return false;
  // Once per device: whether this build has a kernel image for it (else ATen's operators). Read on
  // every call (twice per block and micro-batch): an atomic, no lock; two threads asking at once
  // would both ask CUDA, with the same answer.
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> runs[kMaxDevices];  // 0 not asked yet, 1 runs, -1 does not
  const int d = x.device().index();
  if (d < 0 || d >= kMaxDevices) return false;
  int8_t known = runs[d].load(std::memory_order_relaxed);
  if (known == 0) {
    const c10::cuda::CUDAGuard guard(x.device());
    known = rope_bf16_kernel_runs_here() ? 1 : -1;
    runs[d].store(known, std::memory_order_relaxed);
  }
  return known > 0;
}

at::Tensor apply_rope_cuda_bf16(const at::Tensor& x, const at::Tensor& cis) {
  if (!rope_cuda_bf16_applies(x, cis))
    throw std::invalid_argument("apply_rope_cuda_bf16: x must be bf16 [B, T, H, Dh] on a GPU with a kernel image, "
                                "cis complex64 [>= T, Dh/2] on the same device");
  // (c, s) pairs of fp32, contiguous: [T, Dh/2, 2].
  return RopeBf16::apply(x, at::view_as_real(cis.slice(0, 0, x.size(1))).contiguous(), false);
}

}  // namespace zb
