#pragma once
// The launchers of the project's own CUDA kernels (kernels/*_kernel.cu): plain CUDA, shared by the
// kernels' translation units and their LibTorch wrappers (kernels/cuda_ops.cpp). Each returns the
// launch's error, if any.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace zb {

// RoPE (kernels/rope_kernel.cu): rotates x [rows = B * T, heads * half pairs of bf16] into out on
// `stream` by the table cis [T, half] of fp32 (c, s) pairs, or by its conjugate.
cudaError_t launch_rope_bf16(const void* x, void* out, const void* cis, int64_t rows, int64_t T, int heads, int half,
                             bool conjugate, cudaStream_t stream);

// SwiGLU's gate (kernels/silu_mul_kernel.cu), over n contiguous bf16 values: out = silu(a) * b, and
// its backward from the output's gradient g: ga and gb, the gradients of a and b.
cudaError_t launch_silu_mul_bf16(const void* a, const void* b, void* out, int64_t n, cudaStream_t stream);
cudaError_t launch_silu_mul_backward_bf16(const void* g, const void* a, const void* b, void* ga, void* gb, int64_t n,
                                          cudaStream_t stream);

// The chunked loss's gradient of its logits (kernels/loss_grad_kernel.cu): from z [rows, V] fp32 and
// lse [rows] fp32 (each row's log-sum-exp), g [rows, V] bf16 = exp(z - lse) - onehot, the one-hot at
// column targets[r] - vocab_start where that falls in [0, V). targets: int64 [rows].
cudaError_t launch_softmax_grad_bf16(const void* z, const void* lse, const void* targets, int64_t vocab_start, void* g,
                                     int64_t rows, int64_t V, cudaStream_t stream);

// Each row's log-sum-exp (kernels/loss_grad_kernel.cu): lse [rows] fp32 = log(sum(exp(z[r, :]))) of
// z [rows, V] fp32, computed relative to the row's maximum (as ATen's logsumexp).
cudaError_t launch_row_logsumexp_fp32(const void* z, void* lse, int64_t rows, int64_t V, cudaStream_t stream);

// RMSNorm's backward with the residual stream's gradient added (kernels/rms_norm_kernel.cu): from dy,
// h [rows, D] bf16, the weight w [D] bf16, rstd [rows] fp32 (the forward's) and residual (bf16 like
// dy, or null), dh = the norm's gradient of h + residual, bf16, and per block of the grid the
// weight's gradient summed over its rows, partial [blocks, D] fp32 (blocks:
// rms_norm_backward_bf16_blocks(rows); the caller sums them). Takes D a multiple of 8 up to 8,192
// (rms_norm_backward_bf16_takes) and 16-byte aligned pointers.
bool rms_norm_backward_bf16_takes(int64_t D);
int64_t rms_norm_backward_bf16_blocks(int64_t rows);
cudaError_t launch_rms_norm_backward_bf16(const void* dy, const void* h, const void* w, const void* rstd,
                                          const void* residual, void* dh, void* partial, int64_t rows, int64_t D,
                                          cudaStream_t stream);

// fp32 updates in one pass (kernels/fp32_update_kernel.cu), over n contiguous values: dst (fp32) =
// fma(alpha, src, dst * keep), src bf16 (src_bf16) or fp32; with `read` false dst = alpha * src,
// dst unread. And Muon's momentum: buf = lerp(buf, g, w_buf), and where out is not null
// out = lerp(g, buf, w_out) (buf's new values), all fp32.
cudaError_t launch_scale_add_fp32(void* dst, const void* src, bool src_bf16, float keep, float alpha, bool read,
                                  int64_t n, cudaStream_t stream);
cudaError_t launch_momentum_fp32(void* buf, const void* g, void* out, float w_buf, float w_out, int64_t n,
                                 cudaStream_t stream);

// The cast of a bf16 matrix x [rows, cols] (contiguous) to FP8 (kernels/float8_cast_kernel.cu):
// out [rows, cols] of e4m3 (or e5m2) bytes, each value x * scale saturated and rounded to
// nearest; scale = max / max(amax, 1e-12) (rounded down to a power of two where asked) from the
// fp32 amax of the tensor (amax[0]), of each row (amax[r]) or of each column (amax[c]), by `kind`;
// inverse_scale (fp32, as many values as amax) receives 1 / scale.
constexpr int kFloat8ScaleTensor = 0, kFloat8ScaleRow = 1, kFloat8ScaleColumn = 2;
cudaError_t launch_cast_to_float8_bf16(const void* x, const void* amax, int kind, bool e5m2, bool power_of_two,
                                       void* out, void* inverse_scale, int64_t rows, int64_t cols,
                                       cudaStream_t stream);

// The kernels run on the host instead, serially, every thread of a grid in turn (0: the grid the
// launch would use): their indexing and arithmetic, testable without a GPU (the CUDA math
// library's expf and bf16 conversions have host versions).
void rope_bf16_on_host(const void* x, void* out, const void* cis, int64_t rows, int64_t T, int heads, int half,
                       bool conjugate, int64_t blocks, int threads);
void silu_mul_bf16_on_host(const void* a, const void* b, void* out, int64_t n, int64_t threads);
void silu_mul_backward_bf16_on_host(const void* g, const void* a, const void* b, void* ga, void* gb, int64_t n,
                                    int64_t threads);
void row_logsumexp_fp32_on_host(const void* z, void* lse, int64_t rows, int64_t V, int threads);
void rms_norm_backward_bf16_on_host(const void* dy, const void* h, const void* w, const void* rstd,
                                    const void* residual, void* dh, void* partial, int64_t rows, int64_t D,
                                    int64_t blocks, int threads);
void scale_add_fp32_on_host(void* dst, const void* src, bool src_bf16, float keep, float alpha, bool read, int64_t n,
                            int64_t threads);
void momentum_fp32_on_host(void* buf, const void* g, void* out, float w_buf, float w_out, int64_t n,
                           int64_t threads);
void softmax_grad_bf16_on_host(const void* z, const void* lse, const void* targets, int64_t vocab_start, void* g,
                               int64_t rows, int64_t V, int64_t blocks, int threads);

void cast_to_float8_bf16_on_host(const void* x, const void* amax, int kind, bool e5m2, bool power_of_two, void* out,
                                 void* inverse_scale, int64_t rows, int64_t cols, int64_t threads);

// Whether these kernels have an image for the current device. They are built into one library
// with the same architectures (TORCH_CUDA_ARCH_LIST), so one kernel's answer is every kernel's.
bool kernels_run_here();

}  // namespace zb
