#pragma once
// A mixture of experts, the computation a block's feed-forward place will hold (model/feed_forward.h):
// a router sends each token to top_k of num_experts SwiGLU experts, and the experts' outputs,
// weighted by the router, are summed. Dropless: every token reaches all of its experts, whatever
// their load.
//
// One router serves both families:
//   Mixtral       softmax over the experts, top-k, renormalised over the k (route_norm);
//   DeepSeek-V3   sigmoid, a balancing bias that selects experts but never weights them, top-k
//                 within the best groups of experts, renormalised and scaled (route_scale).
// It runs in fp32 whatever the compute dtype: the scores decide which experts a token reaches.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "model/feed_forward.h"
#include "model/model_args.h"
#include "model_parallel/group.h"

namespace zb {

enum class ScoreFunc { Softmax, Sigmoid };

struct RouterConfig {
  int64_t num_experts = 0;
  int64_t top_k = 1;
  ScoreFunc score_func = ScoreFunc::Softmax;
  bool route_norm = false;   // weights divided by their sum over the k
  double route_scale = 1.0;  // and multiplied by this
  // Group routing (0: none): the experts in num_expert_groups equal groups, each group scored by
  // the sum of its two best scores; a token picks its experts within its num_limited_groups best.
  int64_t num_expert_groups = 0;
  int64_t num_limited_groups = 0;
};

// The router as ModelArgs configures it.
RouterConfig router_config(const ModelArgs& args);

// Where the router sends N tokens.
struct Routing {
  at::Tensor scores;             // [N, E] fp32: every expert's score (softmax or sigmoid), no bias
  at::Tensor experts;            // [N, K] int64: each token's experts, best first
  at::Tensor weights;            // [N, K] fp32: their weights, from the scores without the bias
  at::Tensor tokens_per_expert;  // [E] int64: how many of the N x K assignments each expert got
};

// Routes x [N, D] through the gate [E, D] (no bias term); `bias` [E] fp32, or undefined, is
// DeepSeek-V3's balancing bias: added to the scores that choose, not to the weights. The weights
// carry the gate's gradient; the choice carries none.
Routing route(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& bias, const RouterConfig& config);

// sum_k weights[n, k] * expert_{experts[n, k]}(x[n]) for x [N, D], with the experts' SwiGLU
// weights w1, w3 [E, F, D] and w2 [E, D, F]: expert e computes w2[e] (silu(w1[e] x) * w3[e] x).
// The assignments are sorted expert-major (stable: tokens in order within an expert), the experts'
// rows computed as grouped GEMMs (at::_grouped_mm on the CPU and on a GPU in bf16; one product per
// expert that has rows for fp32 on a GPU), then put back in token order and summed over the k in
// fp32, in a fixed order: the same bits on every run. Returns [N, D] in x's dtype.
at::Tensor routed_experts(const at::Tensor& x, const Routing& routing, const at::Tensor& w1, const at::Tensor& w2,
                          const at::Tensor& w3);

// routed_experts under expert parallelism over `ep` (model_parallel/expert_parallel.h): this rank
// holds experts [rank E/ep, (rank + 1) E/ep) as w1, w3 [E/ep, F, D] and w2 [E/ep, D, F], routes its
// own tokens x [N, D], and exchanges every assignment's row with the rank holding its expert and
// back (all-to-alls: the counts, the rows, the results). A rank's experts compute the rows they
// receive by source rank, in the sources' expert-major order: the result is routed_experts' on the
// whole experts, and the same bits on every run.
at::Tensor routed_experts_parallel(const at::Tensor& x, const Routing& routing, const at::Tensor& w1,
                                   const at::Tensor& w2, const at::Tensor& w3, ModelParallelGroup& ep);

// Balancing.
//
// DeepSeek-V3's auxiliary-loss-free balancing: after a step, each expert's bias moves by `coeff`
// towards the mean load, bias += coeff * sign(mean(n) - n), from n, the tokens each expert got
// over the step on every rank. The moves are centred (their mean taken off) so that the biases do
// not drift together; a shift shared by all experts changes no choice. In place, no gradient.
void update_expert_bias(at::Tensor& bias, const at::Tensor& tokens_per_expert, double coeff);

// DeepSeek-V3's sequence-wise auxiliary loss over `batch` sequences of the routing's N tokens:
// per sequence of T tokens, coeff * sum_i f_i P_i, with f_i = E / (K T) * (the tokens choosing
// expert i) and P_i the mean over its tokens of expert i's score normalised over the experts; the
// mean over the sequences. A balanced routing gives coeff. Its gradient reaches the gate through
// the scores.
at::Tensor sequence_aux_loss(const Routing& routing, int64_t batch, double coeff);

// One mixture-of-experts block's balance over a step (the metrics): the tokens of its busiest and
// idlest expert over the mean, its auxiliary loss (mean over the ranks' micro-batches; 0 without)
// and the spread of its bias (max - min).
struct ExpertBalanceStats {
  int64_t layer = 0;
  double max_load = 0, min_load = 0, aux_loss = 0, bias_spread = 0;
};

// A block's feed-forward as a mixture of experts: h + shared(x) + routed(x), with the shared
// experts the dense SwiGLU of the block's w1/w2/w3 where it has them, the routed ones
// routed_experts() of the block's experts_w1/w2/w3 as route() sends the tokens with its gate and
// its ExpertLoad's bias.
//
// A training forward (gradients on) adds its counts to the ExpertLoad. The first pass of a
// checkpointed block runs without gradients and its recomputation with them, so a micro-batch
// counts once; evaluation runs without and counts nothing. With aux_loss_coeff the sequence-wise
// loss's gradient joins the backward at the block's output, times aux_loss_scale (the trainer's
// division of each micro-batch's loss by their number), so that no loss crosses the blocks.
class MixtureOfExperts : public FeedForward {
 public:
  explicit MixtureOfExperts(const ModelArgs& args);
  at::Tensor forward(const BlockContext& block, const at::Tensor& h, const at::Tensor& x) const override;
  void set_aux_loss_scale(double scale) { aux_loss_scale_ = scale; }

 private:
  RouterConfig router_;
  double aux_loss_coeff_ = 0;
  double aux_loss_scale_ = 1;
  DenseSwiGLU shared_;
};

}  // namespace zb
