#include "model/chunked_loss.h"
#include "model/layers.h"
#include "util/phase.h"
#include "kernels/cuda_ops.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/where.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace zb {

int64_t loss_chunk_tokens(int64_t vocab, bool cuda) {
  const int64_t chunk_bytes = cuda ? int64_t{1} << 30 : int64_t{256} << 20;
  return std::max<int64_t>(1, chunk_bytes / (4 * vocab));
}

namespace {

struct ChunkedCrossEntropy : torch::autograd::Function<ChunkedCrossEntropy> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& w, const at::Tensor& targets,
                                                int64_t chunk_tokens, bool want_x_grad, bool want_w_grad,
                                                ModelParallelGroup* vocab_group, int64_t vocab_start,
                                                bool fused_loss) {
    const int64_t N = x.size(0);
    const auto logits_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    // On CUDA the products of bf16/fp16 inputs are written and summed in fp32 by the GEMM itself
    // (mm/addmm with an output dtype): no reduced-precision [chunk, V] product written and read
    // back to cast it, and the weight's gradient accumulates in place. The CPU has no such kernel
    // (and fp32 or float64 inputs need none): there the product is cast.
    const bool fp32_gemm = x.is_cuda() && x.scalar_type() != logits_dtype;
    // The mean's 1/N is applied to the [chunk, D] and [V, D] products, not to the [chunk, V] logits.
    const double inv_n = 1.0 / static_cast<double>(N);
    at::Tensor loss_sum = at::zeros({}, x.options().dtype(logits_dtype));
    at::Tensor dx = want_x_grad ? at::empty_like(x) : at::Tensor();
    at::Tensor dw = want_w_grad ? at::zeros(w.sizes(), w.options().dtype(logits_dtype)) : at::Tensor();
    const at::Tensor wt = w.t();
    for (int64_t start = 0; start < N; start += chunk_tokens) {
      const int64_t n = std::min(chunk_tokens, N - start);
      Phase phase("zb.loss_chunk", start / chunk_tokens);
      const at::Tensor xc = x.narrow(0, start, n);
      const at::Tensor chunk_targets = targets.narrow(0, start, n);
      at::Tensor tc = chunk_targets.unsqueeze(1);
      at::Tensor z = fp32_gemm ? at::mm(xc, wt, logits_dtype) : at::mm(xc, wt).to(logits_dtype);  // [n, V]
      at::Tensor lse;  // [n, 1]: on a GPU our kernel in one pass over z, else ATen's four
      if (fused_loss && row_logsumexp_cuda_applies(z)) lse = row_logsumexp_cuda(z);
      if (!lse.defined()) lse = at::logsumexp(z, {1}, /*keepdim=*/true);
      at::Tensor target_logit, here;  // here: the target is one of this rank's words (vocab_group)
      if (!vocab_group) {
        target_logit = z.gather(1, tc);
      } else {
        // z holds this rank's words [vocab_start, vocab_start + V): the target's logit is on one
        // rank (0 elsewhere), and the log-sum-exp over all words is that of the ranks' own.
        tc = tc - vocab_start;
        here = tc.ge(0).logical_and(tc.lt(z.size(1)));
        tc = tc.clamp(0, z.size(1) - 1);
        target_logit = at::where(here, z.gather(1, tc), at::zeros_like(lse));
        const int64_t R = vocab_group->size();
        at::Tensor mine = at::cat({lse, target_logit}, 1);  // [n, 2]
        at::Tensor all = at::empty({R, n, 2}, mine.options());
        vocab_group->all_gather(all, mine);
        lse = at::logsumexp(all.select(2, 0), {0}).unsqueeze(1);
        target_logit = all.select(2, 1).sum(0).unsqueeze(1);
      }
      loss_sum += (lse - target_logit).sum();
      if (!want_x_grad && !want_w_grad) continue;
      // d(summed loss)/dz = softmax(z) - onehot(target), cast to x's dtype as the unchunked graph
      // casts it back: on a GPU in bf16 our kernel in one pass, else in z's memory.
      at::Tensor g;
      if (x.scalar_type() == at::kBFloat16 && fused_loss && softmax_grad_cuda_bf16_applies(z, lse, chunk_targets))
        g = softmax_grad_cuda_bf16(z, lse, chunk_targets, vocab_group ? vocab_start : 0);
      if (!g.defined()) {
        z.sub_(lse).exp_();
        at::Tensor one = at::full_like(tc, -1, z.options());  // the one-hot's entry, negated
        if (here.defined()) one = at::where(here, one, at::zeros_like(one));  // another rank's word
        z.scatter_add_(1, tc, one);
        g = z.to(x.scalar_type());
      }
      if (want_x_grad) {
        at::Tensor rows = dx.narrow(0, start, n);  // contiguous: whole rows
        at::addmm_out(rows, rows, g, w, /*beta=*/0, /*alpha=*/inv_n);  // beta 0: rows' old contents unread
      }
      if (want_w_grad) {
        if (fp32_gemm) at::addmm_out(dw, dw, g.t(), xc, logits_dtype, /*beta=*/1, /*alpha=*/inv_n);
        else if (g.scalar_type() == dw.scalar_type()) dw.addmm_(g.t(), xc, /*beta=*/1, /*alpha=*/inv_n);
        else dw.add_(at::mm(g.t(), xc), inv_n);  // CPU bf16: the product, then summed in fp32
      }
    }
    ctx->save_for_backward({dx, dw});
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return {loss_sum / static_cast<double>(N)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& scale = grads[0];  // a scalar: the loss is the graph's end
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    // Scaled in place (nothing else reads them): no second [V, D] buffer.
    at::Tensor dx = saved[0].defined() ? saved[0].mul_(scale) : at::Tensor();
    at::Tensor dw = saved[1].defined() ? saved[1].mul_(scale).to(w_dtype) : at::Tensor();
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_cross_entropy(const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets,
                                 int64_t chunk_tokens, ModelParallelGroup* vocab_group, int64_t vocab_start,
                                 const KernelChoices& kernels) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && targets.numel() == x.size(0),
              "chunked_cross_entropy: x [N, D], w [V, D], targets [N]");
  TORCH_CHECK(chunk_tokens > 0, "chunked_cross_entropy: chunk_tokens must be positive");
  const bool grad = at::GradMode::is_enabled();
  if (vocab_group && vocab_group->size() == 1) vocab_group = nullptr;
  return ChunkedCrossEntropy::apply(x, w, targets.reshape({-1}), chunk_tokens, grad && x.requires_grad(),
                                    grad && w.requires_grad(), vocab_group, vocab_start,
                                    kernels.on(Fused::Loss))[0];
}

}  // namespace zb
