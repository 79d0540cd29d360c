#pragma once
// The Llama building blocks as plain functions of tensors, so that the model can be fed any
// parameter tensors (its own, or views gathered by the sharding engine) and so that each piece
// can be tested alone against a float64 formula.
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/kernel_choices.h"

namespace zb {

// x * rsqrt(mean(x^2, last dim) + eps) * weight, accumulated in fp32, returned in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// A norm of a block's input h that the residual stream also carries on: (h, rms_norm(h, weight)).
// Use the h returned in the residual add. On a GPU in bf16 (fused kernels on) it is h through one
// autograd node with the norm, whose backward (kernels/rms_norm_kernel.cu) adds the residual's
// gradient of h to the norm's in the same pass, where autograd would add them afterwards;
// elsewhere h itself and rms_norm. The forward's numbers are rms_norm's either way.
std::pair<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& h, const at::Tensor& weight, double eps,
                                                     const KernelChoices& kernels = {});
// That node on any device (its backward off the kernel: the same formula in ATen's fp32
// operators), for the tests of a machine without a GPU.
std::pair<at::Tensor, at::Tensor> rms_norm_residual_node(const at::Tensor& h, const at::Tensor& weight, double eps);

// at::linear(x, w) for each weight w, one input shared (the block's wq, wk, wv; w1 and w3): on a
// GPU in bf16 (fused kernels on) as one autograd node whose backward sums x's gradients inside the
// GEMMs (each product added to the last, addmm with beta 1: rounded to bf16 once) where autograd
// would write each product and add them after; elsewhere autograd's own linears.
std::vector<at::Tensor> shared_input_linears(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                             const KernelChoices& kernels = {});
// That node on any device, for the tests of a machine without a GPU.
std::vector<at::Tensor> shared_input_linears_node(const at::Tensor& x, const std::vector<at::Tensor>& weights);

// RoPE table for positions [0, max_positions): exp(j * pos * theta^(-2i/head_dim)) as complex
// numbers, [max_positions, head_dim/2], complex64 (complex128 if `options` asks for float64).
struct RopeTables {
  at::Tensor cis;
};
RopeTables rope_tables(int64_t head_dim, int64_t max_positions, double theta,
                       const at::TensorOptions& options);

// Meta-style rotary embedding on adjacent pairs (2i, 2i+1) of x [B, T, H, Dh]: each pair is the
// complex number x_2i + j*x_2i+1, multiplied by exp(j * pos * freq_i). Computed in fp32
// (float64 for float64 inputs): bf16 on a GPU in one kernel each way (kernels/cuda_ops.h), the rest
// through apply_rope_unfused.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope, const KernelChoices& kernels = {});
// The same with ATen's operators: x through an fp32 copy, one complex multiply, back to x's dtype.
at::Tensor apply_rope_unfused(const at::Tensor& x, const RopeTables& rope);

// Attention: model/attention.h.

// Which of our fused operators run is the KernelChoices value each function takes
// (kernels/kernel_choices.h; all of them by default, where they apply).

// silu(a) * b (a and b of one shape), the gate of SwiGLU: ATen's silu then mul, forward and
// backward, as one autograd node that keeps a and b but not silu(a); bf16 on a GPU in one kernel
// each way. No second derivative. With "gate" off: ATen's silu and mul nodes.
at::Tensor silu_mul(const at::Tensor& a, const at::Tensor& b, const KernelChoices& kernels = {});

// SwiGLU feed-forward: w2(silu_mul(w1 x, w3 x)), no biases.
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3,
                  const KernelChoices& kernels = {});
// Its hidden values silu_mul(w1 x, w3 x), the input of w2.
at::Tensor swiglu_hidden(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3,
                         const KernelChoices& kernels = {});

// h + x w^T (x [.., K], w [D, K], h [.., D]): a block's residual add after its output linear. On a
// GPU in bf16 (fused kernels on; "residual" in runtime.unfused goes around it) one GEMM reads h in
// its epilogue and writes the sum elsewhere (kernels/gemm_add.h): the add's passes over memory saved,
// and the product not rounded to bf16 before h is added (cuBLAS may still round partial sums of
// the product, as in any bf16 GEMM); its backward is addmm's. Elsewhere at::linear, then the add.
at::Tensor residual_linear(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w,
                           const KernelChoices& kernels = {});

}  // namespace zb
