#pragma once
// The project's own CUDA kernels (kernels/cuda_kernels.h) as LibTorch operators, each the same
// numbers as the ATen operators it replaces (but for the rounding of fused multiply-adds), in
// fewer passes over memory. The model asks each whether it applies and takes ATen's path where it
// does not (a tensor off the GPU, another dtype, a build without CUDA). They live in the GPU plugin
// (util/cuda_plugin.h): kernels/cuda_ops.cpp there fills CudaKernelFunctions below, and the
// functions declared here call through it (kernels/cuda_ops_calls.cpp, in every build). Only a GPU
// tensor reaches them, and only where the plugin is loaded.
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <utility>

namespace zb {

// Whether this build has an image of our kernels for `device` (a GPU), asked once per device.
bool cuda_kernels_run_on(const c10::Device& device);

// RoPE for bf16, one kernel each way. Whether the kernel takes x [B, T, H, Dh] (bf16 on a GPU this
// build has a kernel image for) with the RoPE table cis (complex64 [>= T, Dh/2] on the same device).
bool rope_cuda_bf16_applies(const at::Tensor& x, const at::Tensor& cis);
// x rotated by the table's first T rows; throws where rope_cuda_bf16_applies is false.
at::Tensor apply_rope_cuda_bf16(const at::Tensor& x, const at::Tensor& cis);

// SwiGLU's gate for bf16: whether the kernels take a and b (bf16, the same shape, on one GPU this
// build has a kernel image for); silu(a) * b; and from the product's gradient g, those of a and b.
bool silu_mul_cuda_bf16_applies(const at::Tensor& a, const at::Tensor& b);
at::Tensor silu_mul_cuda_bf16(const at::Tensor& a, const at::Tensor& b);
std::pair<at::Tensor, at::Tensor> silu_mul_backward_cuda_bf16(const at::Tensor& g, const at::Tensor& a,
                                                              const at::Tensor& b);

// RMSNorm's backward for bf16 with the residual stream's gradient added (kernels/rms_norm_kernel.cu):
// whether the kernel takes dy, h [.., D] (bf16, contiguous, on one GPU with a kernel image), w [D]
// and rstd (fp32, a value per row); and (dh, dweight): dh = the norm's gradient + residual (bf16
// like dy, or undefined for none), dweight [D] rounded to bf16 as ATen's.
bool rms_norm_backward_cuda_bf16_applies(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& w,
                                         const at::Tensor& rstd);
std::pair<at::Tensor, at::Tensor> rms_norm_backward_cuda_bf16(const at::Tensor& dy, const at::Tensor& h,
                                                             const at::Tensor& w, const at::Tensor& rstd,
                                                             const at::Tensor& residual);

// The chunked loss's log-sum-exp of each row of z (fp32 [n, V] on a GPU with a kernel image) in one
// pass: [n, 1] fp32, as at::logsumexp(z, {1}, true).
bool row_logsumexp_cuda_applies(const at::Tensor& z);
at::Tensor row_logsumexp_cuda(const at::Tensor& z);

// The chunked loss's gradient of its logits as bf16 (softmax(z) - onehot, model/chunked_loss.cpp):
// whether the kernel takes z (fp32 [n, V] on a GPU with a kernel image), lse (fp32, n values) and
// targets (int64, n values) on the same device; and g, bf16 [n, V], the one-hot at targets -
// vocab_start where that is one of z's columns.
bool softmax_grad_cuda_bf16_applies(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets);
at::Tensor softmax_grad_cuda_bf16(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets,
                                  int64_t vocab_start);

// fp32 updates in one pass (kernels/fp32_update_kernel.cu). Whether the kernel takes dst (fp32,
// contiguous, on a GPU with a kernel image) and src (bf16 or fp32, contiguous, dst's shape, on
// its device); dst = dst * keep + alpha * src in place (with `read` false: alpha * src,
// dst's values unread).
bool scale_add_cuda_applies(const at::Tensor& dst, const at::Tensor& src);
void scale_add_cuda_(const at::Tensor& dst, float keep, const at::Tensor& src, float alpha, bool read);
// Muon's momentum: whether the kernel takes buf and g (fp32, contiguous, one shape, on one GPU with
// a kernel image); buf = lerp(buf, g, w_buf) in place, and where out is defined (fp32 shaped as
// buf, contiguous) out = lerp(g, buf, w_out).
bool momentum_cuda_applies(const at::Tensor& buf, const at::Tensor& g);
void momentum_cuda_(const at::Tensor& buf, const at::Tensor& g, const at::Tensor& out, float w_buf, float w_out);

// The FP8 cast of float8/float8.h's to_float8 in one pass (kernels/float8_cast_kernel.cu): whether
// the kernel takes x (bf16, 2-D, contiguous or a transposed view of a contiguous matrix, on a GPU
// with a kernel image); and (data, inverse_scale) as to_float8 returns them, scaled per tensor or,
// with `rowwise`, per row of x (for a transposed view: per column of the matrix under it, the
// FP8 bytes transposed after).
bool float8_cast_cuda_applies(const at::Tensor& x);
std::pair<at::Tensor, at::Tensor> float8_cast_cuda(const at::Tensor& x, at::ScalarType fp8, bool rowwise,
                                                   bool power_of_two);

// cuBLASLt's GEMM with its added term read in the epilogue (kernels/gemm_add.h): whether it takes
// c, a, b (bf16 on one GPU; 2-D, or 3-D with one batch size; a and b row-major or transposed views,
// c row-major, shapes [M, K], [K, N], [M, N]); and beta * c + alpha * a b as a new tensor, or an
// undefined one where cuBLASLt offers no algorithm for these shapes and alignments.
bool gemm_add_cuda_applies(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b);
at::Tensor gemm_add_cuda(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double beta, double alpha);

struct CudaKernelFunctions {
  bool (*cuda_kernels_run_on)(const c10::Device& device);
  bool (*rope_cuda_bf16_applies)(const at::Tensor& x, const at::Tensor& cis);
  at::Tensor (*apply_rope_cuda_bf16)(const at::Tensor& x, const at::Tensor& cis);
  bool (*silu_mul_cuda_bf16_applies)(const at::Tensor& a, const at::Tensor& b);
  at::Tensor (*silu_mul_cuda_bf16)(const at::Tensor& a, const at::Tensor& b);
  std::pair<at::Tensor, at::Tensor> (*silu_mul_backward_cuda_bf16)(const at::Tensor& g, const at::Tensor& a,
                                                                   const at::Tensor& b);
  bool (*rms_norm_backward_cuda_bf16_applies)(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& w,
                                              const at::Tensor& rstd);
  std::pair<at::Tensor, at::Tensor> (*rms_norm_backward_cuda_bf16)(const at::Tensor& dy, const at::Tensor& h,
                                                                   const at::Tensor& w, const at::Tensor& rstd,
                                                                   const at::Tensor& residual);
  bool (*row_logsumexp_cuda_applies)(const at::Tensor& z);
  at::Tensor (*row_logsumexp_cuda)(const at::Tensor& z);
  bool (*softmax_grad_cuda_bf16_applies)(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets);
  at::Tensor (*softmax_grad_cuda_bf16)(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets,
                                       int64_t vocab_start);
  bool (*scale_add_cuda_applies)(const at::Tensor& dst, const at::Tensor& src);
  void (*scale_add_cuda_)(const at::Tensor& dst, float keep, const at::Tensor& src, float alpha, bool read);
  bool (*momentum_cuda_applies)(const at::Tensor& buf, const at::Tensor& g);
  void (*momentum_cuda_)(const at::Tensor& buf, const at::Tensor& g, const at::Tensor& out, float w_buf, float w_out);
  bool (*float8_cast_cuda_applies)(const at::Tensor& x);
  std::pair<at::Tensor, at::Tensor> (*float8_cast_cuda)(const at::Tensor& x, at::ScalarType fp8, bool rowwise,
                                                        bool power_of_two);
  bool (*gemm_add_cuda_applies)(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b);
  at::Tensor (*gemm_add_cuda)(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double beta,
                              double alpha);
};

}  // namespace zb

// The plugin's entry for this table.
extern "C" const zb::CudaKernelFunctions* zb_cuda_kernel_functions(std::size_t table_bytes);
