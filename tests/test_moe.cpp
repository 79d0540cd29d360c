// The mixture of experts (model/moe.h) against a reference written here: each token routed and
// computed alone, by hand, in float64 (no sorting, no grouping), and its gradients by autograd
// over that per-token computation.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <numeric>
#include <vector>

#include "model/llama.h"
#include "reference_data.h"
#include "model/moe.h"

using namespace zb;

namespace {

struct Weights {
  at::Tensor x, gate, w1, w2, w3;  // fp32, requiring gradients
};

Weights random_weights(int64_t N, int64_t D, int64_t E, int64_t F, uint64_t seed) {
  at::manual_seed(seed);
  auto make = [](at::IntArrayRef shape, double scale) { return (at::randn(shape) * scale).requires_grad_(); };
  return {make({N, D}, 1.0), make({E, D}, 0.5), make({E, F, D}, 0.3), make({E, D, F}, 0.3), make({E, F, D}, 0.3)};
}

// The router for one token, in float64: its experts, best first, and their weights.
std::pair<std::vector<int64_t>, std::vector<double>> route_one(const at::Tensor& x, const at::Tensor& gate,
                                                               const std::vector<double>& bias, const RouterConfig& c) {
  const int64_t E = c.num_experts;
  const at::Tensor logits = at::matmul(gate.to(at::kDouble), x.to(at::kDouble));
  std::vector<double> scores(E), choice(E);
  double total = 0;
  for (int64_t e = 0; e < E; ++e) total += std::exp(logits[e].item<double>());
  for (int64_t e = 0; e < E; ++e) {
    const double l = logits[e].item<double>();
    scores[e] = c.score_func == ScoreFunc::Softmax ? std::exp(l) / total : 1 / (1 + std::exp(-l));
    choice[e] = scores[e] + (bias.empty() ? 0.0 : bias[e]);
  }
  if (c.num_expert_groups > 0) {
    const int64_t G = c.num_expert_groups, per = E / G;
    std::vector<double> group_score(G);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> in(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(in.rbegin(), in.rend());
      group_score[g] = in[0] + (per > 1 ? in[1] : 0.0);
    }
    std::vector<int64_t> groups(G);
    std::iota(groups.begin(), groups.end(), 0);
    std::sort(groups.begin(), groups.end(), [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
    for (int64_t i = c.num_limited_groups; i < G; ++i)
      for (int64_t e = groups[i] * per; e < (groups[i] + 1) * per; ++e) choice[e] = -INFINITY;
  }
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
  order.resize(c.top_k);
  std::vector<double> w;
  double sum = 0;
  for (int64_t e : order) w.push_back(scores[e]), sum += scores[e];
  for (double& v : w) v = (c.route_norm ? v / sum : v) * c.route_scale;
  return {order, w};
}

// The whole layer in float64, a token at a time, differentiable: the reference output [N, D].
at::Tensor reference_layer(const Weights& m, const std::vector<double>& bias, const RouterConfig& c) {
  const at::Tensor x = m.x.to(at::kDouble), gate = m.gate.to(at::kDouble);
  const at::Tensor w1 = m.w1.to(at::kDouble), w2 = m.w2.to(at::kDouble), w3 = m.w3.to(at::kDouble);
  std::vector<at::Tensor> rows;
  for (int64_t n = 0; n < x.size(0); ++n) {
    const auto [experts, weights] = route_one(m.x[n].detach(), m.gate.detach(), bias, c);
    // The weights again with autograd, from the gate, as the chosen experts' scores.
    const at::Tensor logits = at::matmul(gate, x[n]);
    const at::Tensor scores = c.score_func == ScoreFunc::Softmax ? at::softmax(logits, 0) : at::sigmoid(logits);
    const at::Tensor chosen = scores.index_select(0, at::tensor(experts, at::kLong));
    at::Tensor wk = c.route_norm ? chosen / chosen.sum() : chosen;
    wk = wk * c.route_scale;
    for (size_t k = 0; k < experts.size(); ++k) EXPECT_NEAR(wk[k].item<double>(), weights[k], 1e-12);
    at::Tensor y = at::zeros({x.size(1)}, x.options());
    for (size_t k = 0; k < experts.size(); ++k) {
      const int64_t e = experts[k];
      y = y + wk[k] * at::matmul(w2[e], at::silu(at::matmul(w1[e], x[n])) * at::matmul(w3[e], x[n]));
    }
    rows.push_back(y);
  }
  return at::stack(rows);
}

// Routes and computes the layer both ways; checks the choice, the output and every gradient.
void expect_matches_reference(const Weights& m, const std::vector<double>& bias, const RouterConfig& c) {
  const at::Tensor bias_tensor = bias.empty() ? at::Tensor() : at::tensor(bias, at::kDouble).to(at::kFloat);
  const Routing r = route(m.x, m.gate, bias_tensor, c);
  const int64_t N = m.x.size(0);
  for (int64_t n = 0; n < N; ++n) {
    const auto [experts, weights] = route_one(m.x[n].detach(), m.gate.detach(), bias, c);
    for (int64_t k = 0; k < c.top_k; ++k) {
      EXPECT_EQ(r.experts[n][k].item<int64_t>(), experts[k]) << "token " << n << ", choice " << k;
      EXPECT_NEAR(r.weights[n][k].item<double>(), weights[k], 1e-5) << "token " << n << ", choice " << k;
    }
  }
  EXPECT_EQ(r.tokens_per_expert.sum().item<int64_t>(), N * c.top_k);
  const at::Tensor y = routed_experts(m.x, r, m.w1, m.w2, m.w3);
  const at::Tensor want = reference_layer(m, bias, c);
  EXPECT_LT((y.to(at::kDouble) - want).abs().max().item<double>(), 1e-5 * (1 + want.abs().max().item<double>()));

  // Gradients of one projection of the output, ours (fp32) against the reference's (float64).
  const at::Tensor probe = at::randn(y.sizes(), at::kDouble);
  const std::vector<at::Tensor> inputs = {m.x, m.gate, m.w1, m.w2, m.w3};
  const std::vector<at::Tensor> ours =
      torch::autograd::grad({(y.to(at::kDouble) * probe).sum()}, inputs, {}, /*retain_graph=*/false, false, true);
  const std::vector<at::Tensor> theirs =
      torch::autograd::grad({(want * probe).sum()}, inputs, {}, /*retain_graph=*/false, false, true);
  const char* names[] = {"x", "gate", "w1", "w2", "w3"};
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor a = ours[i].defined() ? ours[i].to(at::kDouble) : at::zeros_like(theirs[i]);
    const at::Tensor b = theirs[i].defined() ? theirs[i] : at::zeros_like(a);
    EXPECT_TRUE(at::isfinite(a).all().item<bool>()) << names[i];
    EXPECT_LT((a - b).abs().max().item<double>(), 1e-4 * (1 + b.abs().max().item<double>())) << names[i];
  }
}

// A router over 8 experts.
RouterConfig router(int64_t top_k, ScoreFunc score_func, bool route_norm) {
  RouterConfig c;
  c.num_experts = 8;
  c.top_k = top_k;
  c.score_func = score_func;
  c.route_norm = route_norm;
  return c;
}

}  // namespace

// Mixtral's routing: softmax over the 8 experts, the best 2, renormalised.
TEST(MixtureOfExperts, MixtralRoutingMatchesAPerTokenReference) {
  expect_matches_reference(random_weights(48, 16, 8, 24, 1), {}, router(2, ScoreFunc::Softmax, true));
}

// DeepSeek-V3's: sigmoid, a balancing bias that chooses but does not weigh, the best 3 experts
// within the best 2 of 4 groups, renormalised and scaled.
TEST(MixtureOfExperts, DeepSeekRoutingMatchesAPerTokenReference) {
  const Weights m = random_weights(48, 16, 8, 24, 2);
  RouterConfig c = router(3, ScoreFunc::Sigmoid, true);
  c.route_scale = 2.5;
  c.num_expert_groups = 4;
  c.num_limited_groups = 2;
  expect_matches_reference(m, {0.05, -0.1, 0.0, 0.2, -0.05, 0.1, -0.2, 0.0}, c);
  // Without renormalising: the weights are the sigmoid scores themselves.
  c.route_norm = false;
  c.route_scale = 1.0;
  c.num_expert_groups = 0;
  expect_matches_reference(m, {}, c);
}

// A bias that sends every token to one expert: the other seven get none, nothing is NaN, their
// weights get no gradient, and the one expert's weights are the unbiased scores.
TEST(MixtureOfExperts, AllTokensToOneExpertAndExpertsWithoutTokens) {
  const Weights m = random_weights(32, 16, 8, 24, 3);
  const RouterConfig c = router(1, ScoreFunc::Sigmoid, false);
  std::vector<double> bias(8, 0.0);
  bias[5] = 100;
  const Routing r = route(m.x, m.gate, at::tensor(bias, at::kDouble).to(at::kFloat), c);
  EXPECT_EQ(r.tokens_per_expert[5].item<int64_t>(), 32);
  EXPECT_EQ(r.tokens_per_expert.sum().item<int64_t>(), 32);
  EXPECT_LT(r.weights.max().item<float>(), 1.0f);  // a sigmoid score, not the bias
  expect_matches_reference(m, bias, c);
  const at::Tensor y = routed_experts(m.x, r, m.w1, m.w2, m.w3);
  y.sum().backward();
  EXPECT_EQ(m.w1.grad().narrow(0, 0, 5).abs().sum().item<float>(), 0.0f);
  EXPECT_GT(m.w1.grad()[5].abs().sum().item<float>(), 0.0f);
}

// The same inputs give the same bits: the combine sums each token's k outputs in a fixed order.
TEST(MixtureOfExperts, RerunsAreBitIdentical) {
  const Weights m = random_weights(64, 16, 8, 24, 4);
  const RouterConfig c = router(2, ScoreFunc::Softmax, false);
  const at::Tensor a = routed_experts(m.x, route(m.x, m.gate, {}, c), m.w1, m.w2, m.w3);
  const at::Tensor b = routed_experts(m.x, route(m.x, m.gate, {}, c), m.w1, m.w2, m.w3);
  EXPECT_TRUE(at::equal(a, b));
}

// The bias moves each expert by the step's sign towards the mean load, the moves centred.
TEST(MixtureOfExperts, BiasMovesTowardsTheMeanLoad) {
  at::Tensor bias = at::zeros({4});
  update_expert_bias(bias, at::tensor({10, 2, 2, 2}, at::kLong), 0.01);
  // mean 4: signs -1, 1, 1, 1, centred by their mean 0.5.
  const std::vector<float> want = {-0.015f, 0.005f, 0.005f, 0.005f};
  for (int64_t e = 0; e < 4; ++e) EXPECT_FLOAT_EQ(bias[e].item<float>(), want[e]) << e;
  // Routed again and again with the bias updated from each routing's counts, a gate that favours
  // two experts evens out: the busiest expert's load falls towards the mean. (The tokens share a
  // direction, which experts 0 and 1 score highly.)
  const Weights m = random_weights(512, 16, 8, 24, 5);
  {
    at::NoGradGuard no_grad;
    m.x.add_(1.0);
    m.gate.narrow(0, 0, 2).add_(0.3);
  }
  const RouterConfig c = router(2, ScoreFunc::Sigmoid, true);
  at::Tensor b = at::zeros({8});
  auto busiest = [&] {
    const at::Tensor n = route(m.x, m.gate, b, c).tokens_per_expert.to(at::kDouble);
    return (n.max() / n.mean()).item<double>();
  };
  const double before = busiest();
  for (int i = 0; i < 300; ++i) update_expert_bias(b, route(m.x, m.gate, b, c).tokens_per_expert, 1e-2);
  const double after = busiest();
  EXPECT_GT(before, 3.0);
  EXPECT_LT(after, 1.25) << "from " << before;
  std::cout << "busiest expert over the mean: " << before << " before, " << after << " after\n";
  EXPECT_NEAR(b.mean().item<double>(), 0.0, 1e-6);
}

// DeepSeek-V3's sequence-wise loss against a reference written here (float64, a sequence and an
// expert at a time), its gradient to the gate included; a balanced routing gives the coefficient.
TEST(MixtureOfExperts, SequenceAuxLossMatchesAReference) {
  const int64_t B = 3, T = 16, E = 8, K = 2;
  const Weights m = random_weights(B * T, 16, E, 24, 6);
  const RouterConfig c = router(K, ScoreFunc::Sigmoid, true);
  const Routing r = route(m.x, m.gate, {}, c);
  const at::Tensor loss = sequence_aux_loss(r, B, 0.01);
  // The reference: scores again from the gate in float64.
  const at::Tensor scores = at::sigmoid(at::matmul(m.x.to(at::kDouble), m.gate.to(at::kDouble).t()));
  at::Tensor want = at::zeros({}, at::kDouble);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < E; ++i) {
      double count = 0;
      at::Tensor P = at::zeros({}, at::kDouble);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = b * T + t;
        for (int64_t k = 0; k < K; ++k) count += r.experts[n][k].item<int64_t>() == i;
        P = P + scores[n][i] / scores[n].sum() / T;
      }
      want = want + 0.01 * (static_cast<double>(E) / (K * T)) * count * P / B;
    }
  EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-7);
  const at::Tensor ours = torch::autograd::grad({loss}, {m.gate})[0];
  const at::Tensor theirs = torch::autograd::grad({want}, {m.gate})[0];
  EXPECT_LT((ours.to(at::kDouble) - theirs).abs().max().item<double>(), 1e-6 + 1e-4 * theirs.abs().max().item<double>());
  // Balanced: every expert chosen equally often in each sequence, equal scores.
  Routing balanced;
  balanced.scores = at::full({B * T, E}, 0.3);
  balanced.experts = at::arange(B * T * K, at::kLong).remainder(E).view({B * T, K});
  EXPECT_NEAR(sequence_aux_loss(balanced, B, 0.01).item<double>(), 0.01, 1e-9);
}

// ---- The mixture of experts in the model's blocks ----

namespace {

ModelArgs small_moe(double aux_loss_coeff) {
  ModelArgs a;
  a.dim = 32, a.n_layers = 3, a.n_heads = 4, a.n_kv_heads = 2, a.vocab_size = 64, a.multiple_of = 16, a.max_seq_len = 16;
  a.num_experts = 4, a.top_k = 2, a.moe_inter_dim = 24, a.num_shared_experts = 1, a.n_dense_layers = 1;
  a.score_func = "sigmoid", a.route_norm = true, a.aux_loss_coeff = aux_loss_coeff;
  return a;
}

// Every block under activation checkpointing (model/llama.h's StageHooks).
struct CheckpointEveryBlock : StageHooks {
  bool checkpointed(int64_t) const override { return true; }
};

}  // namespace

TEST(MixtureOfExperts, BlocksCountTrainingTokensOnceAndEvaluationNever) {
  const ModelArgs a = small_moe(0.0);
  at::manual_seed(5);
  Llama model(a, at::TensorOptions());
  model.init_weights();
  EXPECT_FALSE(model.expert_loads()[0].tokens.defined());  // the dense first block
  const at::Tensor tokens = at::randint(0, a.vocab_size, {2, 9});
  const at::Tensor in = tokens.narrow(1, 0, 8), targets = tokens.narrow(1, 1, 8);
  const int64_t assignments = 2 * 8 * a.top_k;
  CheckpointEveryBlock recompute;
  for (StageHooks* hooks : {static_cast<StageHooks*>(nullptr), static_cast<StageHooks*>(&recompute)}) {
    for (int64_t l = 1; l < a.n_layers; ++l) model.expert_loads()[l].tokens.zero_();
    model.loss(in, targets, {}, hooks).backward();  // a checkpointed block runs twice, counts once
    for (int64_t l = 1; l < a.n_layers; ++l)
      EXPECT_EQ(model.expert_loads()[l].tokens.sum().item<int64_t>(), assignments) << "layer " << l << (hooks ? ", checkpointed" : "");
    {
      at::NoGradGuard evaluation;
      model.loss(in, targets);
    }
    for (int64_t l = 1; l < a.n_layers; ++l) EXPECT_EQ(model.expert_loads()[l].tokens.sum().item<int64_t>(), assignments);
  }
}

TEST(MixtureOfExperts, AuxiliaryLossGradientIsScaledAndSurvivesRecomputation) {
  // The gate's gradient with the auxiliary loss at scale s is the cross-entropy's plus s times the
  // loss's own: linear in s; and the same with every block checkpointed.
  const ModelArgs a = small_moe(0.01);
  auto gate_grad = [&](double scale, bool checkpoint) {
    at::manual_seed(6);
    Llama model(a, at::TensorOptions());
    model.init_weights();
    model.set_aux_loss_scale(scale);
    const at::Tensor tokens = at::randint(0, a.vocab_size, {2, 9});
    CheckpointEveryBlock recompute;
    model.loss(tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8), {}, checkpoint ? &recompute : nullptr).backward();
    EXPECT_GT(model.expert_loads()[1].aux_loss.item<double>(), 0.0);
    return model.block(1).gate.grad().clone();
  };
  const at::Tensor g0 = gate_grad(0.0, false), g1 = gate_grad(1.0, false), g2 = gate_grad(2.0, false);
  const at::Tensor aux = g1 - g0;
  EXPECT_GT(aux.abs().max().item<double>(), 1e-6);  // the loss reaches the gate
  EXPECT_LE((g2 - g0 - 2 * aux).abs().max().item<double>(), 1e-6);
  EXPECT_LE((gate_grad(1.0, true) - g1).abs().max().item<double>(), 1e-6);
}

// ---- Against transformers' own blocks (tests/reference/moe_reference.py) ----

namespace {
double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }
}  // namespace

// DeepSeek-V3's block (sigmoid, the correction bias choosing, groups, renormalised and scaled, a
// shared expert) and Qwen3-MoE's (softmax, top 2, renormalised or not): the same outputs within
// 1e-5 and the same gradients of x, the gate and the experts within 1e-4, fp32 on both sides.
TEST(MixtureOfExperts, MatchesTransformersDeepSeekV3AndQwen3Blocks) {
  const auto ref = reference::run_reference("moe_reference.py", "");
  struct Case {
    const char* name;
    RouterConfig router;
    bool shared;
  };
  RouterConfig deepseek;
  deepseek.num_experts = 8, deepseek.top_k = 2, deepseek.score_func = ScoreFunc::Sigmoid, deepseek.route_norm = true;
  deepseek.route_scale = 2.5, deepseek.num_expert_groups = 4, deepseek.num_limited_groups = 2;
  RouterConfig qwen_norm;
  qwen_norm.num_experts = 8, qwen_norm.top_k = 2, qwen_norm.route_norm = true;
  RouterConfig qwen_plain = qwen_norm;
  qwen_plain.route_norm = false;
  for (const Case& c : {Case{"deepseek", deepseek, true}, Case{"qwen3_norm", qwen_norm, false},
                        Case{"qwen3_plain", qwen_plain, false}}) {
    const std::string p = std::string(c.name) + "/";
    auto leaf = [](const at::Tensor& t) { return t.clone().requires_grad_(true); };
    const at::Tensor x = leaf(ref[p + "x"]), gate = leaf(ref[p + "gate"]);
    const at::Tensor gate_up = leaf(ref[p + "gate_up"]), down = leaf(ref[p + "down"]);
    const int64_t F = down.size(2);
    // transformers keeps each expert's w1 (gate) and w3 (up) as one [2F, D] tensor.
    const at::Tensor w1 = gate_up.narrow(1, 0, F), w3 = gate_up.narrow(1, F, F);
    const Routing routing = route(x, gate, ref[p + "bias"], c.router);
    at::Tensor out = routed_experts(x, routing, w1, down, w3);
    if (c.shared)
      out = out + at::linear(at::silu(at::linear(x, ref[p + "shared_gate"])) * at::linear(x, ref[p + "shared_up"]),
                             ref[p + "shared_down"]);
    (out * ref[p + "grad_out"]).sum().backward();
    EXPECT_LE(max_abs(out - ref[p + "out"]), 1e-5) << c.name;
    EXPECT_LE(max_abs(x.grad() - ref[p + "grad_x"]), 1e-4) << c.name;
    EXPECT_LE(max_abs(gate.grad() - ref[p + "grad_gate"]), 1e-4) << c.name;
    EXPECT_LE(max_abs(gate_up.grad() - ref[p + "grad_gate_up"]), 1e-4) << c.name;
    EXPECT_LE(max_abs(down.grad() - ref[p + "grad_down"]), 1e-4) << c.name;
  }
}
