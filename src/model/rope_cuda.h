#pragma once
// RoPE for bf16 tensors on CUDA in one kernel each way (model/rope_kernel.cu), the same numbers as
// apply_rope_unfused (model/layers.h) but for the rounding of fused multiply-adds. Compiled only
// where LibTorch has CUDA (ZB_WITH_CUDA); apply_rope chooses it.
#include <ATen/core/Tensor.h>

namespace zb {

// Whether the kernel takes x [B, T, H, Dh] (bf16 on a GPU this build has a kernel image for) with
// the RoPE table cis (complex64 [>= T, Dh/2] on the same device).
bool rope_cuda_bf16_applies(const at::Tensor& x, const at::Tensor& cis);

// x rotated by the table's first T rows; throws where rope_cuda_bf16_applies is false.
at::Tensor apply_rope_cuda_bf16(const at::Tensor& x, const at::Tensor& cis);

}  // namespace zb
