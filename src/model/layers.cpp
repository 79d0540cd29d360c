#include "model/layers.h"
#include "kernels/gemm_add.h"
#include "kernels/cuda_ops.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/_fused_rms_norm.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/view_as_complex.h>
#include <ATen/ops/view_as_real.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>

namespace zb {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // at::rms_norm accumulates reduced-precision inputs in fp32 and uses a fused kernel on CUDA.
  return at::rms_norm(x, {x.size(-1)}, weight.to(x.scalar_type()), eps);
}

namespace {

// (h, rms_norm(h, w)) as one node; w in h's dtype (the caller casts it, as rms_norm does). The
// forward is ATen's fused norm (it also gives each row's rstd, which the backward needs). The
// backward gets two gradients of h: the residual stream's (for the h returned) and the norm's
// output's, and returns their sum, in one kernel on a GPU in bf16.
struct RmsNormResidual : torch::autograd::Function<RmsNormResidual> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                                                const at::Tensor& w, double eps) {
    auto [y, rstd] = at::_fused_rms_norm(h, {h.size(-1)}, w, eps);
    ctx->save_for_backward({h, w, rstd});
    ctx->set_materialize_grads(false);  // an output nothing used: no gradient, not zeros
    return {h, y};  // h as it came (autograd makes the returned h a view with this node's gradient)
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "rms_norm_residual has no second derivative (backward with create_graph)");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor &residual = grads[0], &dy = grads[1];
    if (!dy.defined()) return {residual, at::Tensor(), at::Tensor()};
    if (rms_norm_backward_cuda_bf16_applies(dy, h, w, rstd) &&
        (!residual.defined() || residual.scalar_type() == at::kBFloat16)) {
      auto [dh, dw] = rms_norm_backward_cuda_bf16(dy, h, w, rstd, residual);
      return {dh, dw, at::Tensor()};
    }
    // The kernel's formula in fp32: x_hat = h * rstd, wg = w * dy,
    // dh = rstd * (wg - x_hat * mean(wg * x_hat)), dw = the sum over rows of dy * x_hat.
    const auto work = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor r = rstd.to(work).reshape({-1, 1}), dyf = dy.to(work).reshape({-1, h.size(-1)});
    const at::Tensor x_hat = h.to(work).reshape({-1, h.size(-1)}) * r, wg = dyf * w.to(work);
    at::Tensor dh = (r * (wg - x_hat * (wg * x_hat).mean(-1, /*keepdim=*/true))).to(h.scalar_type()).view(h.sizes());
    if (residual.defined()) dh = dh + residual;
    return {dh, (dyf * x_hat).sum(0).to(w.scalar_type()), at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> rms_norm_residual_node(const at::Tensor& h, const at::Tensor& weight, double eps) {
  auto out = RmsNormResidual::apply(h, weight.to(h.scalar_type()), eps);
  return {out[0], out[1]};
}

std::pair<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& h, const at::Tensor& weight, double eps,
                                                     const KernelChoices& kernels) {
  if (kernels.node_takes(Fused::Norm, h)) return rms_norm_residual_node(h, weight, eps);
  return {h, rms_norm(h, weight, eps)};
}

namespace {

// x [.., D] times each weight w_i [O_i, D]: y_i = x w_i^T. Backward: dx = sum_i dy_i w_i, each
// product accumulated into dx by the GEMM itself; dw_i = dy_i^T x, as autograd's linear computes it.
struct SharedInputLinears : torch::autograd::Function<SharedInputLinears> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                at::TensorList weights) {
    torch::autograd::variable_list out, saved{x};
    for (const at::Tensor& w : weights) {
      out.push_back(at::linear(x, w));
      saved.push_back(w);
    }
    ctx->save_for_backward(saved);
    ctx->set_materialize_grads(false);  // an output nothing used: no product for it, not zeros
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "shared_input_linears has no second derivative (backward with create_graph)");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    at::Tensor dx;
    torch::autograd::variable_list dw;
    for (size_t i = 0; i < grads.size(); ++i) {
      const at::Tensor& w = saved[i + 1];
      if (!grads[i].defined()) {
        dw.emplace_back();
        continue;
      }
      const at::Tensor g = grads[i].reshape({-1, w.size(0)});
      if (ctx->needs_input_grad(0)) {
        if (!dx.defined()) dx = at::mm(g, w);
        else dx.addmm_(g, w);  // beta 1: the sum so far read by the GEMM, not by an add after it
      }
      dw.push_back(ctx->needs_input_grad(i + 1) ? at::mm(g.t(), x2) : at::Tensor());
    }
    if (dx.defined()) dx = dx.view(x.sizes());
    torch::autograd::variable_list result{dx};
    result.insert(result.end(), dw.begin(), dw.end());
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> shared_input_linears_node(const at::Tensor& x, const std::vector<at::Tensor>& weights) {
  return SharedInputLinears::apply(x, at::TensorList(weights));
}

std::vector<at::Tensor> shared_input_linears(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                             const KernelChoices& kernels) {
  if (kernels.node_takes(Fused::Linears, x)) return shared_input_linears_node(x, weights);
  std::vector<at::Tensor> out;
  for (const at::Tensor& w : weights) out.push_back(at::linear(x, w));
  return out;
}

RopeTables rope_tables(int64_t head_dim, int64_t max_positions, double theta,
                       const at::TensorOptions& options) {
  // fp32 tables, as ZeroBand's; float64 when the model itself is float64.
  auto f32 = options.dtype(options.has_dtype() && options.dtype() == at::kDouble ? at::kDouble : at::kFloat);
  // freq_i = theta^(-2i/head_dim), i = 0 .. head_dim/2 - 1
  at::Tensor exponents = at::arange(0, head_dim, 2, f32) / static_cast<double>(head_dim);
  at::Tensor freqs = at::pow(theta, exponents).reciprocal();
  at::Tensor angles = at::outer(at::arange(max_positions, f32), freqs);
  // cos + j sin, built as (cos, sin) pairs: at::polar has no meta-device kernel (dry runs).
  return {at::view_as_complex(at::stack({at::cos(angles), at::sin(angles)}, -1))};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope, const KernelChoices& kernels) {
  // The unfused path moves about five times the bytes of q and k through memory (fp32 copies).
  if (kernels.on(Fused::Rope) && rope_cuda_bf16_applies(x, rope.cis)) return apply_rope_cuda_bf16(x, rope.cis);
  return apply_rope_unfused(x, rope);
}

at::Tensor apply_rope_unfused(const at::Tensor& x, const RopeTables& rope) {
  const int64_t T = x.size(1), half = x.size(3) / 2;
  // One complex multiply per pair (a single elementwise kernel each way, where the cos/sin form
  // took six): fp32 arithmetic for reduced-precision inputs; float64 stays float64.
  const auto work = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor pairs = at::view_as_complex(x.to(work).unflatten(-1, {half, 2}));
  at::Tensor cis = rope.cis.slice(0, 0, T).view({1, T, 1, half});  // broadcast over batch, heads
  return at::view_as_real(pairs * cis).flatten(-2).to(x.scalar_type());
}

namespace {

// silu(a) * b as one autograd node that keeps a and b, not silu(a) as well: autograd's two nodes
// keep all three, and each is as large as the MLP's hidden layer. Its numbers are those of ATen's
// silu then mul, forward and backward: bf16 on a GPU in one kernel each way (kernels/cuda_ops.h),
// the rest through the same ATen operators autograd would call.
struct SiluMul : torch::autograd::Function<SiluMul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(),
                "silu_mul: a and b must have one shape and dtype, got ", a.sizes(), " ", a.scalar_type(), " and ",
                b.sizes(), " ", b.scalar_type());
    ctx->save_for_backward({a, b});
    if (silu_mul_cuda_bf16_applies(a, b)) return silu_mul_cuda_bf16(a, b);
    return at::silu(a) * b;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "silu_mul has no second derivative (backward with create_graph)");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1], &g = grads[0];
    if (silu_mul_cuda_bf16_applies(g, a)) {
      auto [ga, gb] = silu_mul_backward_cuda_bf16(g, a, b);
      return {ga, gb};
    }
    // The product's rule (g * b for silu(a), g * silu(a) for b), then SiLU's backward, written
    // over their own temporaries: no more memory at once than g and the two gradients.
    at::Tensor gb = at::silu(a).mul_(g);
    at::Tensor ga = g * b;
    at::silu_backward_out(ga, ga, a);
    return {ga, gb};
  }
};

}  // namespace

at::Tensor silu_mul(const at::Tensor& a, const at::Tensor& b, const KernelChoices& kernels) {
  return kernels.on(Fused::Gate) ? SiluMul::apply(a, b) : at::silu(a) * b;
}

at::Tensor swiglu_hidden(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w3,
                         const KernelChoices& kernels) {
  const std::vector<at::Tensor> gate_up = shared_input_linears(x, {w1, w3}, kernels);
  return silu_mul(gate_up[0], gate_up[1], kernels);
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3,
                  const KernelChoices& kernels) {
  return at::linear(swiglu_hidden(x, w1, w3, kernels), w2);
}

namespace {

// h + x w^T in one GEMM (gemm_add); the backward is addmm's with x and w^T for its matrices: h's
// gradient the output's as it is, x's g w, and w's g^T x, computed as addmm's backward computes it
// for a transposed matrix: contiguous like w, so that the fp32 gradient sum takes it in one kernel
// (a transposed (x^T g)^T went to ATen's strided add instead: 5.3 ms of the 1B step on an H100).
struct ResidualLinear : torch::autograd::Function<ResidualLinear> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                                                const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    const at::Tensor out = gemm_add(h.reshape({-1, h.size(-1)}), x.reshape({-1, x.size(-1)}), w.t(), 1.0, 1.0,
                                    /*through_cublaslt=*/true);
    return {out.view(h.sizes())};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor g = grads[0].reshape({-1, grads[0].size(-1)});
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    return {grads[0], at::mm(g, w).view(x.sizes()), at::mm(g.t(), x2)};
  }
};

}  // namespace

at::Tensor residual_linear(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w,
                           const KernelChoices& kernels) {
  if (!kernels.node_takes(Fused::Residual, h)) return h + at::linear(x, w);
  return ResidualLinear::apply(h, x, w)[0];
}

}  // namespace zb
