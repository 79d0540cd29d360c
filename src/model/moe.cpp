#include "model/moe.h"

#include "model_parallel/expert_parallel.h"
#include "model_parallel/tensor_parallel.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_grouped_mm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sign.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>

#include <ATen/ops/index_copy.h>
#include <ATen/ops/tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#include <stdexcept>
#include <string>

namespace zb {

RouterConfig router_config(const ModelArgs& a) {
  RouterConfig c;
  c.num_experts = a.num_experts;
  c.top_k = a.top_k;
  c.score_func = a.score_func == "sigmoid" ? ScoreFunc::Sigmoid : ScoreFunc::Softmax;
  c.route_norm = a.route_norm;
  c.route_scale = a.route_scale;
  c.num_expert_groups = a.num_expert_groups;
  c.num_limited_groups = a.num_limited_groups;
  return c;
}

Routing route(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& bias, const RouterConfig& c) {
  const int64_t E = c.num_experts, K = c.top_k, N = x.size(0);
  const int64_t G = c.num_expert_groups;
  if (gate.size(0) != E || K < 1 || K > E ||
      (G > 0 && (E % G != 0 || c.num_limited_groups < 1 || c.num_limited_groups > G || K > c.num_limited_groups * (E / G))))
    throw std::invalid_argument("route: " + std::to_string(E) + " experts in " + std::to_string(G) + " groups (" +
                                std::to_string(c.num_limited_groups) + " chosen), top_k " + std::to_string(K) +
                                ", a gate of " + std::to_string(gate.size(0)) + " rows");
  const at::Tensor logits = at::matmul(x.to(at::kFloat), gate.to(at::kFloat).t());  // [N, E], fp32
  const at::Tensor scores = c.score_func == ScoreFunc::Softmax ? at::softmax(logits, -1) : at::sigmoid(logits);
  // What chooses: the scores (detached: the choice has no gradient), plus the balancing bias.
  at::Tensor choice = scores.detach();
  if (bias.defined()) choice = choice + bias.to(at::kFloat);
  if (G > 0) {
    const int64_t per = E / G;
    const at::Tensor grouped = choice.view({N, G, per});
    // A group's score: the sum of its two best (its best alone when it holds one expert).
    const at::Tensor group_scores = std::get<0>(grouped.topk(std::min<int64_t>(2, per), -1)).sum(-1);  // [N, G]
    const at::Tensor best = std::get<1>(group_scores.topk(c.num_limited_groups, -1));                  // [N, L]
    const at::Tensor outside = at::full({N, G}, true, x.options().dtype(at::kBool)).scatter(1, best, false);
    choice = grouped.masked_fill(outside.unsqueeze(-1), -std::numeric_limits<float>::infinity()).view({N, E});
  }
  Routing r;
  r.scores = scores;
  r.experts = std::get<1>(choice.topk(K, -1, /*largest=*/true, /*sorted=*/true));  // [N, K]
  r.weights = scores.gather(1, r.experts);
  if (c.route_norm) r.weights = r.weights / (r.weights.sum(-1, /*keepdim=*/true) + 1e-20);
  if (c.route_scale != 1.0) r.weights = r.weights * c.route_scale;
  r.tokens_per_expert = at::bincount(r.experts.reshape(-1), {}, E);
  return r;
}

namespace {

// x_e @ w[e]^T for each expert's consecutive rows of x ([rows, in] against w [E, out, in]).
// ATen's grouped GEMM where it runs: on the CPU (fp32 or bf16; faster than a product per expert,
// scripts/perf/moe_experts_cpu.py) and on a GPU in bf16. Its backward takes only a contiguous
// gradient, so the output's is made one.
bool grouped_gemm_runs(const at::Tensor& x) { return !x.is_cuda() || x.scalar_type() == at::kBFloat16; }

// `counts`: the rows of each expert on the host, read only where the grouped GEMM does not run.
at::Tensor grouped_products(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets,
                            const std::vector<int64_t>& counts) {
  if (grouped_gemm_runs(x)) {
    at::Tensor out = at::_grouped_mm(x, w.transpose(-2, -1), offsets);
    if (out.requires_grad()) out.register_hook([](const at::Tensor& grad) { return grad.contiguous(); });
    return out;
  }
  // Elsewhere (fp32 on a GPU) one product per expert that has rows; unbind gives w one gradient
  // rather than one the size of w per expert.
  const std::vector<at::Tensor> experts = w.unbind(0);
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0) parts.push_back(at::matmul(x.narrow(0, start, counts[e]), experts[e].t()));
    start += counts[e];
  }
  return at::cat(parts);
}

}  // namespace

namespace {

// Each expert's SwiGLU on its consecutive rows: w2 (silu(w1 x) * w3 x) through grouped products,
// `counts` [experts] on the rows' device, `host_counts` the same on the host where the grouped
// GEMM does not run (else empty).
at::Tensor experts_swiglu(const at::Tensor& rows, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3,
                          const at::Tensor& counts, const std::vector<int64_t>& host_counts) {
  const at::Tensor offsets = at::cumsum(counts, 0).to(at::kInt);
  const auto dt = rows.scalar_type();
  const at::Tensor gated = at::silu(grouped_products(rows, w1.to(dt), offsets, host_counts)) *
                           grouped_products(rows, w3.to(dt), offsets, host_counts);
  return grouped_products(gated, w2.to(dt), offsets, host_counts);
}

// The expert-major results of the N x K assignments (`order`: their sort) back in (token, k)
// order, and the weighted sum over the k in fp32: [N, D] in `dtype`.
at::Tensor combine(const at::Tensor& out, const at::Tensor& order, const Routing& routing, at::ScalarType dtype) {
  const int64_t N = routing.experts.size(0), K = routing.experts.size(1);
  const at::Tensor back = at::empty_like(order).scatter_(0, order, at::arange(N * K, order.options()));
  const at::Tensor per_token = out.index_select(0, back).view({N, K, out.size(1)}).to(at::kFloat);
  return (per_token * routing.weights.unsqueeze(-1)).sum(1).to(dtype);
}

std::vector<int64_t> host_values(const at::Tensor& t) {
  const at::Tensor h = t.to(at::kCPU, at::kLong).contiguous();
  return {h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel()};
}

}  // namespace

at::Tensor routed_experts(const at::Tensor& x, const Routing& routing, const at::Tensor& w1, const at::Tensor& w2,
                          const at::Tensor& w3) {
  const int64_t K = routing.experts.size(1);
  // Expert-major: a stable sort of the N x K assignments by expert keeps tokens in order within one.
  const at::Tensor order = at::argsort(routing.experts.reshape(-1), /*stable=*/true);
  const at::Tensor rows = x.index_select(0, order.div(K, "floor"));  // [N K, D]
  // The grouped GEMM reads the groups' ends on the device; only the per-expert products need the
  // counts on the host (a wait for the device).
  const std::vector<int64_t> host_counts =
      grouped_gemm_runs(x) ? std::vector<int64_t>{} : host_values(routing.tokens_per_expert);
  return combine(experts_swiglu(rows, w1, w2, w3, routing.tokens_per_expert, host_counts), order, routing,
                 x.scalar_type());
}

at::Tensor routed_experts_parallel(const at::Tensor& x, const Routing& routing, const at::Tensor& w1,
                                   const at::Tensor& w2, const at::Tensor& w3, ModelParallelGroup& ep) {
  const int64_t K = routing.experts.size(1), n = ep.size(), E = routing.tokens_per_expert.size(0);
  const int64_t local = E / n;  // this rank's experts: [rank * local, (rank + 1) * local)
  TORCH_CHECK(E % n == 0 && w1.size(0) == local, "expert parallelism: ", E, " experts over ", n,
              " ranks, but this rank holds ", w1.size(0));
  // Expert-major as on one rank: the rows for rank j's experts are consecutive, in rank order.
  // (Each buffer below is let go as soon as the next is made: forward holds a few of [N K, D].)
  const at::Tensor order = at::argsort(routing.experts.reshape(-1), /*stable=*/true);
  // The counts: what this rank sends each rank, and what each sends to each of this rank's experts.
  const std::vector<int64_t> mine = host_values(routing.tokens_per_expert);
  const at::Tensor theirs = exchange_expert_counts(routing.tokens_per_expert, ep);  // [n, local], host
  const int64_t* from = theirs.data_ptr<int64_t>();
  std::vector<int64_t> send(n, 0), recv(n, 0), per_expert(local, 0);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t e = 0; e < local; ++e) {
      send[j] += mine[j * local + e];
      recv[j] += from[j * local + e];
      per_expert[e] += from[j * local + e];
    }
  // By source rank, experts within each.
  at::Tensor received = exchange_rows(x.index_select(0, order.div(K, "floor")), send, recv, ep);
  // Source-major to expert-major (by source within an expert: a fixed order), computed, and back.
  std::vector<int64_t> by_expert;
  by_expert.reserve(received.size(0));
  std::vector<int64_t> source_start(n, 0);
  for (int64_t j = 1; j < n; ++j) source_start[j] = source_start[j - 1] + recv[j - 1];
  for (int64_t e = 0; e < local; ++e)
    for (int64_t j = 0; j < n; ++j) {
      int64_t start = source_start[j];
      for (int64_t f = 0; f < e; ++f) start += from[j * local + f];
      for (int64_t r = 0; r < from[j * local + e]; ++r) by_expert.push_back(start + r);
    }
  // And back: the row by_expert[i] became is row i. (A permutation by index_select, whose backward
  // keeps only the indices; index_copy's would keep the whole result.)
  std::vector<int64_t> by_source(by_expert.size());
  for (size_t i = 0; i < by_expert.size(); ++i) by_source[static_cast<size_t>(by_expert[i])] = static_cast<int64_t>(i);
  at::Tensor computed;
  if (received.size(0) == 0) {
    // No rows for this rank's experts: an empty result that still hands them (zero) gradients.
    computed = received * (w1.sum() + w2.sum() + w3.sum()).to(received.scalar_type());
  } else {
    const at::Tensor counts = at::tensor(per_expert, order.options());
    at::Tensor sorted = received.index_select(0, at::tensor(by_expert, order.options()));
    received.reset();
    computed = experts_swiglu(sorted, w1, w2, w3, counts, grouped_gemm_runs(x) ? std::vector<int64_t>{} : per_expert);
    sorted.reset();
    computed = computed.index_select(0, at::tensor(by_source, order.options()));
  }
  const at::Tensor returned = exchange_rows(computed, recv, send, ep);  // [N K, D], expert-major
  computed.reset();
  return combine(returned, order, routing, x.scalar_type());
}

void update_expert_bias(at::Tensor& bias, const at::Tensor& tokens_per_expert, double coeff) {
  at::NoGradGuard no_grad;
  const at::Tensor n = tokens_per_expert.to(at::kFloat);
  at::Tensor move = coeff * at::sign(n.mean() - n);
  move -= move.mean();
  bias += move.to(bias.device(), bias.scalar_type());
}

at::Tensor sequence_aux_loss(const Routing& routing, int64_t batch, double coeff) {
  const int64_t N = routing.scores.size(0), E = routing.scores.size(1), K = routing.experts.size(1), T = N / batch;
  if (batch < 1 || N % batch != 0)
    throw std::invalid_argument("sequence_aux_loss: " + std::to_string(N) + " tokens in " + std::to_string(batch) +
                                " sequences");
  // f: each sequence's count of tokens choosing each expert, times E / (K T). No gradient.
  const at::Tensor chosen = at::zeros({batch, E}, routing.scores.options())
                                .scatter_add_(1, routing.experts.view({batch, T * K}),
                                              at::ones({batch, T * K}, routing.scores.options()));
  const at::Tensor f = chosen * (static_cast<double>(E) / static_cast<double>(K * T));
  // P: each sequence's mean of the scores normalised over the experts.
  const at::Tensor normalised = routing.scores / routing.scores.sum(-1, /*keepdim=*/true);
  const at::Tensor P = normalised.view({batch, T, E}).mean(1);
  return coeff * (f * P).sum(-1).mean();
}

namespace {

// The identity on the block's output whose backward also hands `aux`, a loss computed inside the
// block, the gradient `scale` (what the loss it would be added to gets), so that the loss needs no
// path out of the block.
struct AttachAuxLoss : torch::autograd::Function<AttachAuxLoss> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out,
                                                const at::Tensor& aux, double scale) {
    ctx->saved_data["scale"] = scale;
    return {out};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    // The auxiliary loss is an fp32 scalar (the router's scores are fp32).
    const at::Tensor aux_grad = at::full({}, scale, grads[0].options().dtype(at::kFloat));
    return {grads[0], aux_grad, at::Tensor()};
  }
};

}  // namespace

MixtureOfExperts::MixtureOfExperts(const ModelArgs& args)
    : router_(router_config(args)), aux_loss_coeff_(args.aux_loss_coeff) {}

at::Tensor MixtureOfExperts::forward(const BlockContext& block, const at::Tensor& h, const at::Tensor& x) const {
  const TransformerBlockParams& b = block.params;
  TORCH_CHECK(block.experts, "MixtureOfExperts: block ", block.layer, " has no ExpertLoad");
  const ExpertLoad& load = *block.experts;
  const int64_t D = x.size(-1);
  const at::Tensor tokens = x.reshape({-1, D});
  // Under TP each rank routes its own positions through whole experts: the router's and the
  // experts' gradients, from those positions alone, are summed over the group in backward.
  auto whole = [&](const at::Tensor& w) { return block.tp ? replicated_weight(w, *block.tp) : w; };
  const Routing routing = route(tokens, whole(b.gate), load.bias, router_);
  const bool training = at::GradMode::is_enabled();
  if (training) load.tokens.add_(routing.tokens_per_expert);
  at::Tensor routed;
  if (block.ep) {
    // The stacks hold this rank's experts (the sharding engine gathers those alone); the EP group
    // may hold TP ranks, whose experts differ: the engine's expert shard group sums their gradients.
    routed = routed_experts_parallel(tokens, routing, b.experts_w1, b.experts_w2, b.experts_w3, *block.ep);
  } else {
    routed = routed_experts(tokens, routing, whole(b.experts_w1), whole(b.experts_w2), whole(b.experts_w3));
  }
  routed = routed.view(x.sizes());
  // The shared experts and the residual in one (DenseSwiGLU adds h), then the routed experts.
  at::Tensor out = (b.w1.defined() ? shared_.forward(block, h, x) : h) + routed;
  if (aux_loss_coeff_ > 0 && training) {
    const at::Tensor aux = sequence_aux_loss(routing, x.size(0), aux_loss_coeff_);
    load.aux_loss.add_(aux.detach());
    out = AttachAuxLoss::apply(out, aux, aux_loss_scale_)[0];
  }
  return out;
}

}  // namespace zb
