#include "model/rope_cuda.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/view_as_real.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>
#include <string>

namespace zb {

cudaError_t launch_rope_bf16(const void* x, void* out, const void* cis, int64_t pairs, int64_t T, int64_t heads,
                             int64_t half, bool conjugate, cudaStream_t stream);

namespace {

// x rotated by the table (or its conjugate) into a new contiguous tensor, on x's device and stream.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cis_pairs, bool conjugate) {
  at::Tensor in = x.contiguous();
  if (in.storage_offset() % 2 != 0) in = in.clone();  // pairs read as 4-byte words
  at::Tensor out = at::empty_like(in);
  const c10::cuda::CUDAGuard guard(in.device());
  const cudaError_t err = launch_rope_bf16(in.const_data_ptr(), out.mutable_data_ptr(), cis_pairs.const_data_ptr(),
                                           in.numel() / 2, in.size(1), in.size(2), in.size(3) / 2, conjugate,
                                           c10::cuda::getCurrentCUDAStream(in.device().index()).stream());
  if (err != cudaSuccess) throw std::runtime_error(std::string("RoPE kernel launch: ") + cudaGetErrorString(err));
  return out;
}

// Autograd: the rotation is linear in x, so backward rotates the gradient by the conjugate and
// saves nothing but the table.
struct RopeBf16 : torch::autograd::Function<RopeBf16> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cis_pairs) {
    ctx->saved_data["cis"] = cis_pairs;
    return rotate(x, cis_pairs, false);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {rotate(grads[0], ctx->saved_data["cis"].toTensor(), true), at::Tensor()};
  }
};

}  // namespace

at::Tensor apply_rope_cuda_bf16(const at::Tensor& x, const at::Tensor& cis) {
  if (x.dim() != 4 || x.size(3) % 2 != 0 || cis.size(0) != x.size(1) || 2 * cis.size(1) != x.size(3))
    throw std::invalid_argument("apply_rope_cuda_bf16: x must be [B, T, H, Dh] with Dh even and cis [T, Dh/2]");
  // (c, s) pairs of fp32, contiguous: [T, Dh/2, 2].
  return RopeBf16::apply(x, at::view_as_real(cis).contiguous());
}

}  // namespace zb
