#pragma once
// RoPE for bf16 tensors on CUDA in one kernel each way (model/rope_kernel.cu), the same numbers as
// apply_rope_unfused (model/layers.h) but for the rounding of fused multiply-adds. Compiled only
// where LibTorch has CUDA and nvcc is found (ZB_CUDA_KERNELS); apply_rope chooses it.
#include <ATen/core/Tensor.h>

namespace zb {

// x [B, T, H, Dh] bf16 on a GPU; cis the RoPE table's first T rows (complex64, [T, Dh/2]) on it.
at::Tensor apply_rope_cuda_bf16(const at::Tensor& x, const at::Tensor& cis);

}  // namespace zb
