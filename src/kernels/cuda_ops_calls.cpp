// kernels/cuda_ops.h's functions, called through the GPU plugin's table (util/cuda_plugin.h).
#include "kernels/cuda_ops.h"

#include "util/cuda_plugin.h"

namespace zb {

namespace {
const CudaKernelFunctions& gpu() {
  static const CudaKernelFunctions& table = required_cuda_plugin_table<CudaKernelFunctions>(
      "zb_cuda_kernel_functions", "our CUDA kernels asked for without the GPU plugin (util/cuda_plugin.h)");
  return table;
}
}  // namespace

bool cuda_kernels_run_on(const c10::Device& device) {
  static const bool loaded = cuda_plugin_symbol("zb_cuda_kernel_functions") != nullptr;
  return device.is_cuda() && loaded && gpu().cuda_kernels_run_on(device);
}
bool rope_cuda_bf16_applies(const at::Tensor& x, const at::Tensor& cis) {
  return x.is_cuda() && gpu().rope_cuda_bf16_applies(x, cis);
}
at::Tensor apply_rope_cuda_bf16(const at::Tensor& x, const at::Tensor& cis) { return gpu().apply_rope_cuda_bf16(x, cis); }
bool silu_mul_cuda_bf16_applies(const at::Tensor& a, const at::Tensor& b) {
  return a.is_cuda() && gpu().silu_mul_cuda_bf16_applies(a, b);
}
at::Tensor silu_mul_cuda_bf16(const at::Tensor& a, const at::Tensor& b) { return gpu().silu_mul_cuda_bf16(a, b); }
std::pair<at::Tensor, at::Tensor> silu_mul_backward_cuda_bf16(const at::Tensor& g, const at::Tensor& a,
                                                              const at::Tensor& b) {
  return gpu().silu_mul_backward_cuda_bf16(g, a, b);
}
bool rms_norm_backward_cuda_bf16_applies(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& w,
                                         const at::Tensor& rstd) {
  return dy.is_cuda() && gpu().rms_norm_backward_cuda_bf16_applies(dy, h, w, rstd);
}
std::pair<at::Tensor, at::Tensor> rms_norm_backward_cuda_bf16(const at::Tensor& dy, const at::Tensor& h,
                                                             const at::Tensor& w, const at::Tensor& rstd,
                                                             const at::Tensor& residual) {
  return gpu().rms_norm_backward_cuda_bf16(dy, h, w, rstd, residual);
}
bool row_logsumexp_cuda_applies(const at::Tensor& z) { return z.is_cuda() && gpu().row_logsumexp_cuda_applies(z); }
at::Tensor row_logsumexp_cuda(const at::Tensor& z) { return gpu().row_logsumexp_cuda(z); }
bool softmax_grad_cuda_bf16_applies(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets) {
  return z.is_cuda() && gpu().softmax_grad_cuda_bf16_applies(z, lse, targets);
}
at::Tensor softmax_grad_cuda_bf16(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets,
                                  int64_t vocab_start) {
  return gpu().softmax_grad_cuda_bf16(z, lse, targets, vocab_start);
}
bool scale_add_cuda_applies(const at::Tensor& dst, const at::Tensor& src) {
  return dst.is_cuda() && gpu().scale_add_cuda_applies(dst, src);
}
void scale_add_cuda_(const at::Tensor& dst, float keep, const at::Tensor& src, float alpha, bool read) {
  gpu().scale_add_cuda_(dst, keep, src, alpha, read);
}
bool momentum_cuda_applies(const at::Tensor& buf, const at::Tensor& g) {
  return buf.is_cuda() && gpu().momentum_cuda_applies(buf, g);
}
void momentum_cuda_(const at::Tensor& buf, const at::Tensor& g, const at::Tensor& out, float w_buf, float w_out) {
  gpu().momentum_cuda_(buf, g, out, w_buf, w_out);
}
bool float8_cast_cuda_applies(const at::Tensor& x) { return x.is_cuda() && gpu().float8_cast_cuda_applies(x); }
std::pair<at::Tensor, at::Tensor> float8_cast_cuda(const at::Tensor& x, at::ScalarType fp8, bool rowwise,
                                                   bool power_of_two) {
  return gpu().float8_cast_cuda(x, fp8, rowwise, power_of_two);
}
bool gemm_add_cuda_applies(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  return c.is_cuda() && gpu().gemm_add_cuda_applies(c, a, b);
}
at::Tensor gemm_add_cuda(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double beta, double alpha) {
  return gpu().gemm_add_cuda(c, a, b, beta, alpha);
}

}  // namespace zb
