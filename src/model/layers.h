#pragma once
// The Llama building blocks as plain functions of tensors, so that the model can be fed any
// parameter tensors (its own, or views gathered by the sharding engine) and so that each piece
// can be tested alone against a float64 formula.
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace zb {

// x * rsqrt(mean(x^2, last dim) + eps) * weight, accumulated in fp32, returned in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// A norm of a block's input h that the residual stream also carries on: (h, rms_norm(h, weight)).
// Use the h returned in the residual add. On a GPU in bf16 (fused kernels on) it is h through one
// autograd node with the norm, whose backward (model/rms_norm_kernel.cu) adds the residual's
// gradient of h to the norm's in the same pass, where autograd would add them afterwards;
// elsewhere h itself and rms_norm. The forward's numbers are rms_norm's either way.
std::pair<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& h, const at::Tensor& weight, double eps);
// That node on any device (its backward off the kernel: the same formula in ATen's fp32
// operators), for the tests of a machine without a GPU.
std::pair<at::Tensor, at::Tensor> rms_norm_residual_node(const at::Tensor& h, const at::Tensor& weight, double eps);

// at::linear(x, w) for each weight w, one input shared (the block's wq, wk, wv; w1 and w3): on a
// GPU in bf16 (fused kernels on) as one autograd node whose backward sums x's gradients inside the
// GEMMs (each product added to the last, addmm with beta 1: rounded to bf16 once) where autograd
// would write each product and add them after; elsewhere autograd's own linears.
std::vector<at::Tensor> shared_input_linears(const at::Tensor& x, const std::vector<at::Tensor>& weights);
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
// (float64 for float64 inputs): bf16 on a GPU in one kernel each way (model/cuda_ops.h), the rest
// through apply_rope_unfused.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);
// The same with ATen's operators: x through an fp32 copy, one complex multiply, back to x's dtype.
at::Tensor apply_rope_unfused(const at::Tensor& x, const RopeTables& rope);

// Attention: model/attention.h.

// Our fused operators (SwiGLU's gate as one node; on CUDA our kernels for it and RoPE,
// model/cuda_ops.h) where they apply, or, off, the model as ATen's operators alone, as autograd
// differentiates them (runtime.fused_kernels: for comparison, and a way around them). On by
// default; process-wide.
void use_fused_kernels(bool on);
// Each of them by name, to measure what one gives or to go around one: "rope", "gate" (SwiGLU's),
// "loss" (its log-sum-exp and logit gradient), "norm" (RMSNorm with the residual's gradient),
// "linears" (shared_input_linears), "update" (the fp32 gradient sums and Muon's update of the
// weights, model/fp32_updates.h), "momentum" (Muon's), "residual" (residual_linear's one GEMM),
// "newton_schulz" (Muon's GEMMs reading their added term in the epilogue, model/gemm_add.h).
// leave_unfused(names) turns the named ones off (all on first; runtime.unfused, comma-separated;
// validation names the known ones); an unknown name is std::invalid_argument.
enum class Fused { Rope, Gate, Loss, Norm, Linears, Update, Momentum, Residual, NewtonSchulz };
std::vector<std::string> fused_operator_names();
std::vector<std::string> split_operator_names(const std::string& list);  // "a, b" -> {"a", "b"}
void leave_unfused(const std::vector<std::string>& names);
bool fused_on(Fused op);
// Whether our CUDA kernels run on `device`: a GPU this build has their image for (they take bf16).
bool fused_kernels_run_on(const c10::Device& device);
// For tests on a machine without a GPU: the autograd nodes that on a GPU call our kernels
// (rms_norm_residual, shared_input_linears) taken on any device and dtype, where they run their
// formulas in ATen's operators; so a whole model trains through them. Off by default; process-wide.
void use_fused_nodes_on_any_device(bool on);

// silu(a) * b (a and b of one shape), the gate of SwiGLU: ATen's silu then mul, forward and
// backward, as one autograd node that keeps a and b but not silu(a); bf16 on a GPU in one kernel
// each way. No second derivative. With use_fused_kernels(false): ATen's silu and mul nodes.
at::Tensor silu_mul(const at::Tensor& a, const at::Tensor& b);

// SwiGLU feed-forward: w2(silu_mul(w1 x, w3 x)), no biases.
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3);
// Its hidden values silu_mul(w1 x, w3 x), the input of w2.
at::Tensor swiglu_hidden(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3);

// h + x w^T (x [.., K], w [D, K], h [.., D]): a block's residual add after its output linear. On a
// GPU in bf16 (fused kernels on; "residual" in runtime.unfused goes around it) one GEMM reads h in
// its epilogue and writes the sum elsewhere (model/gemm_add.h): the add's passes over memory saved,
// and the product not rounded to bf16 before h is added (cuBLAS may still round partial sums of
// the product, as in any bf16 GEMM); its backward is addmm's. Elsewhere at::linear, then the add.
at::Tensor residual_linear(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w);

}  // namespace zb
