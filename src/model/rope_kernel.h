#pragma once
// The launcher of RoPE's bf16 kernel (model/rope_kernel.cu): plain CUDA, shared by the kernel's
// translation unit and its LibTorch wrapper (model/rope_cuda.cpp).
#include <cuda_runtime_api.h>

#include <cstdint>

namespace zb {

// Rotates x [rows = B * T, heads * half pairs of bf16] into out on `stream` by the table cis
// [T, half] of fp32 (c, s) pairs, or by its conjugate; the launch's error, if any.
cudaError_t launch_rope_bf16(const void* x, void* out, const void* cis, int64_t rows, int64_t T, int heads, int half,
                             bool conjugate, cudaStream_t stream);

// Whether the kernel has an image for the current device (built for TORCH_CUDA_ARCH_LIST).
bool rope_bf16_kernel_runs_here();

}  // namespace zb
