#include "model/cuda_ops.h"
#include "model/cuda_kernels.h"

#include <ATen/ops/empty.h>
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

// Once per device: whether this build has a kernel image for it (else ATen's operators). Read on
// every call (several per block and micro-batch): an atomic, no lock; two threads asking at once
// would both ask CUDA, with the same answer.
bool cuda_kernels_run_on(const c10::Device& device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> runs[kMaxDevices];  // 0 not asked yet, 1 runs, -1 does not
  const int d = device.index();
  if (d < 0 || d >= kMaxDevices) return false;
  int8_t known = runs[d].load(std::memory_order_relaxed);
  if (known == 0) {
    const c10::cuda::CUDAGuard guard(device);
    known = kernels_run_here() ? 1 : -1;
    runs[d].store(known, std::memory_order_relaxed);
  }
  return known > 0;
}

bool rope_cuda_bf16_applies(const at::Tensor& x, const at::Tensor& cis) {
  return x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 4 && x.size(3) % 2 == 0 &&
         cis.scalar_type() == at::kComplexFloat && cis.device() == x.device() && cis.dim() == 2 &&
         cis.size(0) >= x.size(1) && 2 * cis.size(1) == x.size(3) && x.size(2) * x.size(3) / 2 <= (1 << 30) &&
         cuda_kernels_run_on(x.device());
}

at::Tensor apply_rope_cuda_bf16(const at::Tensor& x, const at::Tensor& cis) {
  if (!rope_cuda_bf16_applies(x, cis))
    throw std::invalid_argument("apply_rope_cuda_bf16: x must be bf16 [B, T, H, Dh] on a GPU with a kernel image, "
                                "cis complex64 [>= T, Dh/2] on the same device");
  // (c, s) pairs of fp32, contiguous: [T, Dh/2, 2].
  return RopeBf16::apply(x, at::view_as_real(cis.slice(0, 0, x.size(1))).contiguous(), false);
}

bool silu_mul_cuda_bf16_applies(const at::Tensor& a, const at::Tensor& b) {
  return a.is_cuda() && a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 &&
         b.device() == a.device() && a.sizes() == b.sizes() && cuda_kernels_run_on(a.device());
}

at::Tensor silu_mul_cuda_bf16(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(silu_mul_cuda_bf16_applies(a, b), "silu_mul_cuda_bf16: a and b must be bf16 of one shape on a GPU with "
              "a kernel image");
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  at::Tensor out = at::empty_like(ca);
  const c10::cuda::CUDAGuard guard(a.device());
  C10_CUDA_CHECK(launch_silu_mul_bf16(ca.const_data_ptr(), cb.const_data_ptr(), out.mutable_data_ptr(), ca.numel(),
                                      c10::cuda::getCurrentCUDAStream(a.device().index()).stream()));
  return out;
}

std::pair<at::Tensor, at::Tensor> silu_mul_backward_cuda_bf16(const at::Tensor& g, const at::Tensor& a,
                                                              const at::Tensor& b) {
  TORCH_CHECK(silu_mul_cuda_bf16_applies(a, b) && silu_mul_cuda_bf16_applies(g, a),
              "silu_mul_backward_cuda_bf16: g, a and b must be bf16 of one shape on a GPU with a kernel image");
  const at::Tensor cg = g.contiguous(), ca = a.contiguous(), cb = b.contiguous();
  at::Tensor ga = at::empty_like(ca), gb = at::empty_like(ca);
  const c10::cuda::CUDAGuard guard(a.device());
  C10_CUDA_CHECK(launch_silu_mul_backward_bf16(cg.const_data_ptr(), ca.const_data_ptr(), cb.const_data_ptr(),
                                               ga.mutable_data_ptr(), gb.mutable_data_ptr(), ca.numel(),
                                               c10::cuda::getCurrentCUDAStream(a.device().index()).stream()));
  return {ga, gb};
}

bool rms_norm_backward_cuda_bf16_applies(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& w,
                                         const at::Tensor& rstd) {
  if (!(h.is_cuda() && h.scalar_type() == at::kBFloat16 && dy.scalar_type() == at::kBFloat16 &&
        w.scalar_type() == at::kBFloat16 && rstd.scalar_type() == at::kFloat && h.dim() >= 1 &&
        dy.sizes() == h.sizes() && w.dim() == 1 && w.size(0) == h.size(-1) && rstd.numel() * h.size(-1) == h.numel() &&
        dy.device() == h.device() && w.device() == h.device() && rstd.device() == h.device() &&
        cuda_kernels_run_on(h.device())))
    return false;
  // The kernel's widths; the tensors are made contiguous and aligned by the call.
  return rms_norm_backward_bf16_takes(h.size(-1));
}

std::pair<at::Tensor, at::Tensor> rms_norm_backward_cuda_bf16(const at::Tensor& dy, const at::Tensor& h,
                                                             const at::Tensor& w, const at::Tensor& rstd,
                                                             const at::Tensor& residual) {
  TORCH_CHECK(rms_norm_backward_cuda_bf16_applies(dy, h, w, rstd), "rms_norm_backward_cuda_bf16: dy and h bf16 [.., D] "
              "with D a multiple of 8 up to 8192, w bf16 [D], rstd fp32 a value per row, on one GPU with a kernel image");
  TORCH_CHECK(!residual.defined() || (residual.sizes() == h.sizes() && residual.scalar_type() == at::kBFloat16 &&
                                      residual.device() == h.device()),
              "rms_norm_backward_cuda_bf16: the residual's gradient must be bf16 shaped as h");
  // Whole tensors from the caching allocator start 512-byte aligned; a view off alignment is copied.
  auto aligned = [](const at::Tensor& t) {
    at::Tensor c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 == 0 ? c : c.clone();
  };
  const at::Tensor cdy = aligned(dy), ch = aligned(h), cw = aligned(w), crstd = rstd.contiguous();
  const at::Tensor cres = residual.defined() ? aligned(residual) : at::Tensor();
  const int64_t D = h.size(-1), rows = h.numel() / D;
  at::Tensor dh = at::empty(h.sizes(), ch.options());
  at::Tensor partial = at::empty({rms_norm_backward_bf16_blocks(rows), D}, crstd.options());
  const c10::cuda::CUDAGuard guard(h.device());
  C10_CUDA_CHECK(launch_rms_norm_backward_bf16(cdy.const_data_ptr(), ch.const_data_ptr(), cw.const_data_ptr(),
                                               crstd.const_data_ptr(), cres.defined() ? cres.const_data_ptr() : nullptr,
                                               dh.mutable_data_ptr(), partial.mutable_data_ptr(), rows, D,
                                               c10::cuda::getCurrentCUDAStream(h.device().index()).stream()));
  return {dh, partial.sum(0).to(w.scalar_type())};
}

bool row_logsumexp_cuda_applies(const at::Tensor& z) {
  return z.is_cuda() && z.scalar_type() == at::kFloat && z.dim() == 2 && cuda_kernels_run_on(z.device());
}

at::Tensor row_logsumexp_cuda(const at::Tensor& z) {
  TORCH_CHECK(row_logsumexp_cuda_applies(z), "row_logsumexp_cuda: z must be fp32 [n, V] on one GPU with a kernel image");
  const at::Tensor cz = z.contiguous();
  at::Tensor lse = at::empty({cz.size(0), 1}, cz.options());
  const c10::cuda::CUDAGuard guard(z.device());
  C10_CUDA_CHECK(launch_row_logsumexp_fp32(cz.const_data_ptr(), lse.mutable_data_ptr(), cz.size(0), cz.size(1),
                                           c10::cuda::getCurrentCUDAStream(z.device().index()).stream()));
  return lse;
}

bool softmax_grad_cuda_bf16_applies(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets) {
  return z.is_cuda() && z.scalar_type() == at::kFloat && z.dim() == 2 && lse.scalar_type() == at::kFloat &&
         lse.numel() == z.size(0) && lse.device() == z.device() && targets.scalar_type() == at::kLong &&
         targets.numel() == z.size(0) && targets.device() == z.device() && cuda_kernels_run_on(z.device());
}

at::Tensor softmax_grad_cuda_bf16(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets,
                                  int64_t vocab_start) {
  TORCH_CHECK(softmax_grad_cuda_bf16_applies(z, lse, targets), "softmax_grad_cuda_bf16: z must be fp32 [n, V], lse "
              "fp32 and targets int64 of n values, on one GPU with a kernel image");
  const at::Tensor cz = z.contiguous(), clse = lse.contiguous(), ct = targets.contiguous();
  at::Tensor g = at::empty(cz.sizes(), cz.options().dtype(at::kBFloat16));
  const c10::cuda::CUDAGuard guard(z.device());
  C10_CUDA_CHECK(launch_softmax_grad_bf16(cz.const_data_ptr(), clse.const_data_ptr(), ct.const_data_ptr(), vocab_start,
                                          g.mutable_data_ptr(), cz.size(0), cz.size(1),
                                          c10::cuda::getCurrentCUDAStream(z.device().index()).stream()));
  return g;
}

bool scale_add_cuda_applies(const at::Tensor& dst, const at::Tensor& src) {
  return dst.is_cuda() && dst.scalar_type() == at::kFloat && dst.is_contiguous() &&
         (src.scalar_type() == at::kBFloat16 || src.scalar_type() == at::kFloat) && src.is_contiguous() &&
         src.sizes() == dst.sizes() && src.device() == dst.device() && cuda_kernels_run_on(dst.device());
}

void scale_add_cuda_(const at::Tensor& dst, float keep, const at::Tensor& src, float alpha, bool read) {
  TORCH_CHECK(scale_add_cuda_applies(dst, src), "scale_add_cuda_: dst must be fp32 and src bf16 or fp32, both "
              "contiguous with as many values, on one GPU with a kernel image");
  const c10::cuda::CUDAGuard guard(dst.device());
  C10_CUDA_CHECK(launch_scale_add_fp32(dst.mutable_data_ptr(), src.const_data_ptr(),
                                       src.scalar_type() == at::kBFloat16, keep, alpha, read, dst.numel(),
                                       c10::cuda::getCurrentCUDAStream(dst.device().index()).stream()));
  dst.unsafeGetTensorImpl()->bump_version();  // written in place, as ATen's in-place operators count
}

bool momentum_cuda_applies(const at::Tensor& buf, const at::Tensor& g) {
  return buf.is_cuda() && buf.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat && buf.is_contiguous() &&
         g.is_contiguous() && buf.sizes() == g.sizes() && g.device() == buf.device() &&
         cuda_kernels_run_on(buf.device());
}

void momentum_cuda_(const at::Tensor& buf, const at::Tensor& g, const at::Tensor& out, float w_buf, float w_out) {
  TORCH_CHECK(momentum_cuda_applies(buf, g) && (!out.defined() || momentum_cuda_applies(out, g)),
              "momentum_cuda_: buf, g (and out) must be fp32, contiguous, of one shape on one GPU with a kernel "
              "image");
  const c10::cuda::CUDAGuard guard(buf.device());
  C10_CUDA_CHECK(launch_momentum_fp32(buf.mutable_data_ptr(), g.const_data_ptr(),
                                      out.defined() ? out.mutable_data_ptr() : nullptr, w_buf, w_out, buf.numel(),
                                      c10::cuda::getCurrentCUDAStream(buf.device().index()).stream()));
  buf.unsafeGetTensorImpl()->bump_version();
}

}  // namespace zb
