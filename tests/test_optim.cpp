// Learning-rate schedules, AdamW, gradient clipping and the grouping of parameters by role.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "config/config.h"
#include "model/llama.h"
#include "config/model_config.h"
#include "optim/adamw.h"
#include "parallel/clip.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "optim/outer_nesterov.h"
#include "optim/param_groups.h"

using namespace zb;

TEST(LrSchedule, CosineLinearWsdSqrtAtChosenSteps) {
  LrSchedule cos{"cosine", 10, 0, 110};
  EXPECT_DOUBLE_EQ(cos.multiplier(1), 0.1);  // warmup: step/warmup
  EXPECT_DOUBLE_EQ(cos.multiplier(5), 0.5);
  EXPECT_DOUBLE_EQ(cos.multiplier(10), 1.0);
  EXPECT_NEAR(cos.multiplier(35), 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-15);
  EXPECT_NEAR(cos.multiplier(60), 0.5, 1e-15);
  EXPECT_NEAR(cos.multiplier(110), 0.0, 1e-15);
  EXPECT_EQ(cos.multiplier(200), 0.0);  // clamped past the end

  LrSchedule lin{"linear", 10, 0, 110};
  EXPECT_DOUBLE_EQ(lin.multiplier(3), 0.3);
  EXPECT_DOUBLE_EQ(lin.multiplier(35), 0.75);
  EXPECT_DOUBLE_EQ(lin.multiplier(110), 0.0);

  LrSchedule wsd{"wsd-sqrt", 10, 60, 110};
  EXPECT_DOUBLE_EQ(wsd.multiplier(4), 0.4);
  EXPECT_DOUBLE_EQ(wsd.multiplier(30), 1.0);  // stable
  EXPECT_DOUBLE_EQ(wsd.multiplier(59), 1.0);
  EXPECT_DOUBLE_EQ(wsd.multiplier(60), 1.0);
  EXPECT_NEAR(wsd.multiplier(72.5 + 0.5), 1 - std::sqrt(13.0 / 50.0), 1e-15);
  EXPECT_NEAR(wsd.multiplier(110), 0.0, 1e-15);

  LrSchedule no_warmup{"cosine", 0, 0, 10};
  EXPECT_NEAR(no_warmup.multiplier(5), 0.5, 1e-15);
}

TEST(AdamW, MatchesTheFormulaInFloat64) {
  // Two steps of decoupled-weight-decay Adam with bias correction, computed by hand.
  at::manual_seed(0);
  const double lr = 0.01, b1 = 0.8, b2 = 0.95, eps = 1e-10, wd = 0.1;
  at::Tensor p = at::randn({3, 4}, at::kDouble).requires_grad_(true);
  at::Tensor ref = p.detach().clone(), m = at::zeros_like(ref), v = at::zeros_like(ref);
  AdamW opt;
  opt.add_group("g", {lr, b1, b2, eps, wd}, {p});
  for (int t = 1; t <= 3; ++t) {
    at::Tensor g = at::randn({3, 4}, at::kDouble);
    p.mutable_grad() = g.clone();
    opt.step(0.5);  // the schedule's multiplier scales lr
    const double lr_t = lr * 0.5;
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    at::Tensor m_hat = m / (1 - std::pow(b1, t)), v_hat = v / (1 - std::pow(b2, t));
    ref = ref * (1 - lr_t * wd) - lr_t * m_hat / (v_hat.sqrt() + eps);
    EXPECT_LT((p.detach() - ref).abs().max().item<double>(), 1e-14) << "step " << t;
    EXPECT_EQ(opt.groups()[0].step[0].item<double>(), t);
  }
}

TEST(Clip, ScalesToMaxNormAndReportsTheNormBefore) {
  at::Tensor a = at::zeros({2}).requires_grad_(true), b = at::zeros({1}).requires_grad_(true);
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  at::Tensor norm = clip_grad_norm_({a, b}, 1.0);
  EXPECT_NEAR(norm.item<double>(), 5.0, 1e-6);
  EXPECT_NEAR(a.grad()[0].item<double>(), 0.6, 1e-6);
  EXPECT_NEAR(b.grad()[0].item<double>(), 0.8, 1e-6);
  // Below the threshold nothing changes.
  const at::Tensor before = a.grad().clone();
  norm = clip_grad_norm_({a, b}, 10.0);
  EXPECT_NEAR(norm.item<double>(), 1.0, 1e-6);
  EXPECT_TRUE(at::equal(a.grad(), before));
  // A norm that is not finite leaves the gradients as they are (the trainer skips the step).
  b.mutable_grad() = at::tensor({NAN});
  EXPECT_TRUE(std::isnan(clip_grad_norm_({a, b}, 1.0).item<double>()));
  EXPECT_TRUE(at::equal(a.grad(), before));
}

// The norm of a long fp32 gradient to float precision (float64 the reference), whether the
// gradient is whole or split in two (as over two ranks' shards): ATen's own CPU norm
// is off by 4e-4 at this length, and the two ways 2e-4 apart.
TEST(Clip, LongGradientsNormedToFloatPrecisionHoweverSplit) {
  at::manual_seed(0);
  const at::Tensor g = at::randn({10'000'000});
  const double exact = g.to(at::kDouble).norm().item<double>();
  at::Tensor whole = at::zeros({10'000'000}).requires_grad_(true);
  whole.mutable_grad() = g.clone();
  at::Tensor first = at::zeros({4'000'000}).requires_grad_(true), rest = at::zeros({6'000'000}).requires_grad_(true);
  first.mutable_grad() = g.slice(0, 0, 4'000'000).clone();
  rest.mutable_grad() = g.slice(0, 4'000'000).clone();
  const double one = clip_grad_norm_({whole}, 0).item<double>();
  const double two = clip_grad_norm_({first, rest}, 0).item<double>();
  EXPECT_NEAR(one / exact, 1.0, 1e-6);
  EXPECT_NEAR(two / exact, 1.0, 1e-6);
  EXPECT_NEAR(one / two, 1.0, 1e-6);
  // Any strides: the same elements as a transposed [4000, 2500] view.
  at::Tensor transposed = at::zeros({4000, 2500}).requires_grad_(true);
  transposed.mutable_grad() = g.view({2500, 4000}).t();
  EXPECT_NEAR(clip_grad_norm_({transposed}, 0).item<double>() / exact, 1.0, 1e-6);
}

TEST(ParamGroups, ByRoleForEveryPreset) {
  for (const char* name : {"debugmodel", "150M", "1B", "7B"}) {
    ModelArgs a = lookup_model_args("llama2", name);
    Llama model(a, at::TensorOptions().device(at::kMeta));
    auto groups = group_parameters(whole_parameters(model.parameters()));
    ASSERT_EQ(groups.size(), 4u) << name;
    EXPECT_EQ(groups[0].role, ParamRole::Hidden);
    EXPECT_EQ(groups[0].params.size(), static_cast<size_t>(7 * a.n_layers)) << name;
    for (const auto& p : groups[0].params) {
      EXPECT_EQ(p.tensor->dim(), 2);
      EXPECT_EQ(p.name.rfind("layers.", 0), 0u);
    }
    EXPECT_EQ(groups[1].role, ParamRole::Embedding);
    ASSERT_EQ(groups[1].params.size(), 1u);
    EXPECT_EQ(groups[1].params[0].name, "tok_embeddings.weight");
    EXPECT_EQ(groups[2].role, ParamRole::Head);
    ASSERT_EQ(groups[2].params.size(), 1u);
    EXPECT_EQ(groups[2].params[0].name, "output.weight");
    EXPECT_EQ(groups[3].role, ParamRole::Norm);
    EXPECT_EQ(groups[3].params.size(), static_cast<size_t>(2 * a.n_layers + 1)) << name;
    size_t total = 0;
    for (const auto& g : groups) total += g.params.size();
    EXPECT_EQ(total, model.parameters().size());
  }
}

TEST(Optimizer, MuonForHiddenMatricesAdamWForTheRest) {
  Config c = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n[train]\n"
                                "[data]\nfake = true\n[optim.adam]\nlr_head = 0.5\n", "t.toml");
  ModelArgs a = resolve_model_args(c);
  a.max_seq_len = 8;
  Llama model(a, at::TensorOptions());
  Optimizer opt(c, whole_parameters(model.parameters()), model.kernels());
  ASSERT_NE(opt.muon(), nullptr);
  EXPECT_EQ(opt.muon()->params().size(), 14u);  // 7 matrices x 2 blocks
  EXPECT_EQ(opt.muon()->params()[0].name, "layers.0.attention.wq.weight");
  const auto lrs = opt.learning_rates(0.5);
  ASSERT_EQ(lrs.size(), 4u);
  EXPECT_EQ(lrs[0], (std::pair<std::string, double>{"muon", 0.01}));
  EXPECT_EQ(lrs[1], (std::pair<std::string, double>{"embedding", 0.3}));
  EXPECT_EQ(lrs[2], (std::pair<std::string, double>{"head", 0.25}));  // from [optim.adam]
  EXPECT_EQ(lrs[3], (std::pair<std::string, double>{"norm", 0.02}));
  const auto& head = opt.adamw().groups()[1].hyper;
  EXPECT_EQ(head.beta1, 0.8);
  EXPECT_EQ(head.beta2, 0.95);
  EXPECT_EQ(head.eps, 1e-10);
  EXPECT_EQ(head.weight_decay, 0.01);
  // Named state: a momentum buffer per Muon matrix, AdamW moments and step per other tensor.
  const auto state = opt.state();
  EXPECT_EQ(state.size(), 14u + 3u * (1 + 1 + 5));
  EXPECT_EQ(state[0].param + "." + state[0].key, "layers.0.attention.wq.weight.momentum_buffer");
  EXPECT_EQ(state[14].param + "." + state[14].key, "tok_embeddings.weight.exp_avg");
  EXPECT_EQ(state[16].param + "." + state[16].key, "tok_embeddings.weight.step");
}

TEST(Optimizer, AdamWEverywhereWhenAsked) {
  Config c = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n[train]\n"
                                "[data]\nfake = true\n[optim.optim]\ntype = \"adamw\"\nlr = 0.003\n", "t.toml");
  ModelArgs a = resolve_model_args(c);
  a.max_seq_len = 8;
  Llama model(a, at::TensorOptions());
  Optimizer opt(c, whole_parameters(model.parameters()), model.kernels());
  EXPECT_EQ(opt.muon(), nullptr);
  EXPECT_EQ(opt.learning_rates(1.0)[0], (std::pair<std::string, double>{"hidden", 0.003}));
  EXPECT_EQ(opt.adamw().groups()[0].params.size(), 14u);
}

// DiLoCo's outer step against PyTorch's own SGD with Nesterov momentum, fed the same pseudo-
// gradients: three outer steps of two "replicas" drifting from the outer values, averaged.
TEST(OuterNesterov, MatchesTorchSgdWithNesterovMomentum) {
  at::manual_seed(5);
  const double lr = 0.7, momentum = 0.9;
  std::vector<at::Tensor> inner = {at::randn({6, 4}), at::randn({5})};
  OuterNesterov outer(lr, momentum);
  outer.start_from(inner);
  std::vector<at::Tensor> ref;
  for (const at::Tensor& t : inner) ref.push_back(t.clone().requires_grad_(true));
  torch::optim::SGD sgd(ref, torch::optim::SGDOptions(lr).momentum(momentum).nesterov(true));
  for (int step = 0; step < 3; ++step) {
    // Two replicas' inner steps, as drifts from the common start; their pseudo-gradients averaged.
    std::vector<at::Tensor> drift_a, drift_b;
    for (const at::Tensor& t : inner) {
      drift_a.push_back(at::randn(t.sizes()) * 0.1);
      drift_b.push_back(at::randn(t.sizes()) * 0.1);
    }
    std::vector<at::Tensor> averaged;
    std::vector<at::Tensor> replica_a, replica_b;
    for (size_t i = 0; i < inner.size(); ++i) {
      replica_a.push_back(inner[i] + drift_a[i]);
      replica_b.push_back(inner[i] + drift_b[i]);
    }
    const auto da = outer.pseudo_gradients(replica_a), db = outer.pseudo_gradients(replica_b);
    for (size_t i = 0; i < inner.size(); ++i) averaged.push_back((da[i] + db[i]) / 2);
    for (size_t i = 0; i < inner.size(); ++i) ref[i].mutable_grad() = averaged[i].clone();
    sgd.step();
    outer.step(averaged, inner);
    for (size_t i = 0; i < inner.size(); ++i) {
      EXPECT_TRUE(at::allclose(inner[i], ref[i].detach(), 1e-6, 1e-7)) << "step " << step << " tensor " << i;
      EXPECT_TRUE(at::equal(inner[i], outer.outer()[i]));  // every replica restarts from the outer values
    }
  }
}

// The invariants: one replica with lr 1 and no momentum is plain training (the outer values
// become the inner ones); a zero pseudo-gradient changes nothing but the momentum's decay.
TEST(OuterNesterov, OneReplicaWithLrOneIsPlainTrainingAndZeroDeltaOnlyDecaysMomentum) {
  at::manual_seed(6);
  std::vector<at::Tensor> inner = {at::randn({3, 3})};
  OuterNesterov plain(1.0, 0.0);
  plain.start_from(inner);
  const at::Tensor trained = inner[0] + at::randn({3, 3});  // the inner steps' result
  std::vector<at::Tensor> now = {trained.clone()};
  plain.step(plain.pseudo_gradients(now), now);
  EXPECT_TRUE(at::allclose(now[0], trained, 0, 1e-7));

  OuterNesterov nesterov(0.7, 0.9);
  nesterov.start_from(inner);
  std::vector<at::Tensor> moved = {inner[0] + 0.5};
  nesterov.step(nesterov.pseudo_gradients(moved), moved);  // momentum now holds the first Δ
  const at::Tensor after_first = moved[0].clone(), buffer = nesterov.momentum_buffers()[0].clone();
  nesterov.step(nesterov.pseudo_gradients(moved), moved);  // Δ = 0: θ -= lr·μ·(μ·b)
  EXPECT_TRUE(at::allclose(nesterov.momentum_buffers()[0], buffer * 0.9, 1e-6, 1e-7));
  EXPECT_TRUE(at::allclose(moved[0], after_first - 0.7 * 0.9 * (buffer * 0.9), 1e-6, 1e-7));
}
