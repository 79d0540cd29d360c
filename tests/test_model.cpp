// The Llama model: sizes of every preset, parameter layout, initialisation, gradients against
// finite differences, and that it can learn (overfit one batch).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

#include "model/chunked_loss.h"
#include "model/llama.h"
#include "model/model_args.h"
#include "model/model_args_json.h"
#include "optim/adamw.h"

using namespace zb;

namespace {
ModelArgs llama2(const std::string& name, int64_t vocab) {
  ModelArgs a = lookup_model_args("llama2", name);
  a.vocab_size = vocab;
  return a;
}
}  // namespace

TEST(ModelSizes, MatchZeroBandTable) {
  // Reference: ZeroBand's size table (llama2 family; 32000-token vocabulary, 1024 for debug).
  struct Row { const char* name; int64_t vocab, total, without_embedding; };
  const Row rows[] = {
      {"debugmodel", 1024, 2'229'504, 1'967'360},          // 2.23M / 1.97M
      {"150M", 32000, 219'702'272, 186'934'272},           // 219.7M / 186.9M
      {"1B", 32000, 1'055'991'808, 990'455'808},           // 1,056.0M / 990.5M
      {"7B", 32000, 6'738'415'616, 6'607'343'616},         // 6,738.4M / 6,607.3M (Llama-2-7B)
  };
  for (const auto& r : rows) {
    ModelArgs a = llama2(r.name, r.vocab);
    EXPECT_EQ(count_params(a), r.total) << r.name;
    EXPECT_EQ(count_params_without_embedding(a), r.without_embedding) << r.name;
  }
  // The 1B block: 4*dim^2 + 3*dim*hidden + 2*dim.
  ModelArgs b = llama2("1B", 32000);
  EXPECT_EQ(b.ffn_hidden(), 5632);
  EXPECT_EQ(4 * b.dim * b.dim + 3 * b.dim * b.ffn_hidden() + 2 * b.dim, 51'384'320);
  // llama3 rounding with a multiplier: 1B hidden int(1.3 * 5461) = 7099 -> 7168.
  EXPECT_EQ(lookup_model_args("llama3", "1B").ffn_hidden(), 7168);
  EXPECT_EQ(lookup_model_args("llama3", "8B").ffn_hidden(), 14336);
  EXPECT_EQ(lookup_model_args("llama2", "70B").ffn_hidden(), 28672);
}

TEST(ModelArgsJson, RoundTripsEveryKeyAndNamesAMissingOne) {
  ModelArgs a = lookup_model_args("llama3", "1B");
  a.vocab_size = 1000, a.max_seq_len = 77, a.norm_eps = 2e-6, a.rope_theta = 5e5;
  const nlohmann::json j = model_args_to_json(a);
  // The keys of a checkpoint's meta.json "model_args", exactly.
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"dim", "ffn_dim_multiplier", "max_seq_len", "multiple_of",
                                            "n_heads", "n_kv_heads", "n_layers", "norm_eps",
                                            "rope_theta", "vocab_size"}));
  // Through text, as meta.json is.
  const ModelArgs b = model_args_from_json(nlohmann::json::parse(j.dump()));
  EXPECT_EQ(b.dim, a.dim);
  EXPECT_EQ(b.n_layers, a.n_layers);
  EXPECT_EQ(b.n_heads, a.n_heads);
  EXPECT_EQ(b.n_kv_heads, a.n_kv_heads);
  EXPECT_EQ(b.vocab_size, 1000);
  EXPECT_EQ(b.multiple_of, a.multiple_of);
  EXPECT_DOUBLE_EQ(b.ffn_dim_multiplier, a.ffn_dim_multiplier);
  EXPECT_DOUBLE_EQ(b.norm_eps, 2e-6);
  EXPECT_DOUBLE_EQ(b.rope_theta, 5e5);
  EXPECT_EQ(b.max_seq_len, 77);

  nlohmann::json missing = j;
  missing.erase("rope_theta");
  try {
    model_args_from_json(missing);
    ADD_FAILURE() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "model_args: missing key 'rope_theta'");
  }
}

TEST(ModelSizes, FlopsPerTokenByHand) {
  // 1B at T=1024: 6 * 990,455,808 + 12 * 18 layers * 16 heads * 128 head_dim * 1024 tokens.
  const double expected = 6.0 * 990455808.0 + 12.0 * 18 * 16 * 128 * 1024;
  EXPECT_DOUBLE_EQ(flops_per_token(llama2("1B", 32000), 1024), expected);
  EXPECT_NEAR(expected, 6.396e9, 0.001e9);
}

TEST(Model, ParametersFollowTheSpecs) {
  ModelArgs a = llama2("debugmodel", 1024);
  Llama model(a, at::TensorOptions().device(at::kCPU));
  const auto specs = param_specs(a);
  ASSERT_EQ(model.parameters().size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(model.parameters()[i].name, specs[i].name);
    EXPECT_EQ(model.parameters()[i].slot->sizes().vec(), specs[i].shape) << specs[i].name;
    EXPECT_TRUE(model.parameters()[i].slot->requires_grad());
    EXPECT_EQ(model.parameters()[i].slot->scalar_type(), at::kFloat);
  }
  EXPECT_EQ(model.parameters()[1].name, "layers.0.attention.wq.weight");
  EXPECT_EQ(model.num_params(), 2'229'504);
}

TEST(Model, OneBOnMetaDeviceAllocatesNothing) {
  Llama model(llama2("1B", 32000), at::TensorOptions().device(at::kMeta));
  model.init_weights();  // a no-op on meta
  EXPECT_EQ(model.num_params(), 1'055'991'808);
  EXPECT_TRUE(model.tok_embeddings().is_meta());
}

TEST(Model, InitialisationFollowsZeroBand) {
  at::manual_seed(0);
  ModelArgs a = llama2("debugmodel", 1024);
  Llama model(a, at::TensorOptions());
  model.init_weights();
  auto std_of = [](const at::Tensor& t) { return t.std().item<double>(); };
  EXPECT_NEAR(std_of(model.tok_embeddings()), 1.0, 0.01);
  EXPECT_NEAR(std_of(model.block(0).wq), 0.02, 0.001);
  EXPECT_NEAR(std_of(model.block(0).w1), 0.02, 0.001);
  EXPECT_NEAR(std_of(model.block(0).wo), 0.02 / std::sqrt(2.0), 0.001);  // depth-scaled
  EXPECT_NEAR(std_of(model.block(1).w2), 0.02 / std::sqrt(4.0), 0.001);
  const double head_std = 1.0 / std::sqrt(256.0);
  EXPECT_LE(model.output().abs().max().item<double>(), 3 * head_std);  // cut at 3 std
  // A normal truncated at +-3 std has std 0.9866 of the untruncated one.
  EXPECT_NEAR(std_of(model.output()), 0.9866 * head_std, 0.002);
  EXPECT_EQ(model.norm().min().item<double>(), 1.0);
  EXPECT_EQ(model.block(1).ffn_norm.max().item<double>(), 1.0);
}

TEST(Model, ForwardReadsSwappedSlots) {
  // The sharding engine replaces a parameter's slot with a gathered view and back.
  at::manual_seed(1);
  ModelArgs a = llama2("debugmodel", 1024);
  a.max_seq_len = 16;
  Llama model(a, at::TensorOptions());
  model.init_weights();
  at::Tensor tokens = at::randint(3, 1024, {2, 16}, at::kLong);
  at::NoGradGuard no_grad;
  at::Tensor before = model.forward(tokens);
  at::Tensor saved = model.block(1).w2;
  model.block(1).w2 = at::zeros_like(saved);  // a different tensor in the slot
  at::Tensor swapped = model.forward(tokens);
  EXPECT_GT((swapped - before).abs().max().item<double>(), 1e-4);
  model.block(1).w2 = saved;
  EXPECT_TRUE(at::equal(model.forward(tokens), before));
  EXPECT_EQ(before.sizes(), (std::vector<int64_t>{2, 16, 1024}));
  EXPECT_EQ(before.scalar_type(), at::kFloat);
}

TEST(Model, GradientsMatchFiniteDifferences) {
  // A tiny model in float64 (GQA, two blocks): autograd against central differences.
  at::manual_seed(2);
  ModelArgs a;
  a.dim = 16;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = 32;
  a.multiple_of = 8;
  a.max_seq_len = 6;
  Llama model(a, at::TensorOptions().dtype(at::kDouble));
  model.init_weights();
  {  // Norm weights of exactly 1 make their gradients special; perturb everything a little.
    at::NoGradGuard no_grad;
    for (const auto& p : model.parameters()) p.slot->add_(at::randn_like(*p.slot) * 0.05);
  }
  at::Tensor tokens = at::randint(0, 32, {2, 6}, at::kLong);
  at::Tensor targets = at::randint(0, 32, {2, 6}, at::kLong);
  auto loss_fn = [&] { return cross_entropy(model.forward(tokens), targets); };
  loss_fn().backward();

  const double h = 1e-6;
  int checked = 0;
  for (const auto& p : model.parameters()) {
    at::Tensor flat = p.slot->detach().view({-1});
    at::Tensor grad = p.slot->grad().view({-1});
    for (int k = 0; k < 3; ++k) {  // three random coordinates per parameter
      const int64_t i = at::randint(0, flat.numel(), {1}, at::kLong).item<int64_t>();
      const double orig = flat[i].item<double>();
      at::NoGradGuard no_grad;
      flat[i].fill_(orig + h);
      const double up = loss_fn().item<double>();
      flat[i].fill_(orig - h);
      const double down = loss_fn().item<double>();
      flat[i].fill_(orig);
      const double numeric = (up - down) / (2 * h);
      const double analytic = grad[i].item<double>();
      EXPECT_NEAR(analytic, numeric, 1e-7 + 1e-5 * std::abs(numeric)) << p.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3 * static_cast<int>(model.parameters().size()));
}

TEST(Model, Bf16ComputeKeepsFp32MasterGradients) {
  at::manual_seed(3);
  ModelArgs a = llama2("debugmodel", 1024);
  a.max_seq_len = 16;
  Llama model(a, at::TensorOptions());
  model.init_weights();
  at::Tensor tokens = at::randint(3, 1024, {2, 16}, at::kLong);
  at::Tensor targets = at::randint(3, 1024, {2, 16}, at::kLong);
  at::Tensor fp32_loss = cross_entropy(model.forward(tokens), targets);
  model.set_compute_dtype(at::kBFloat16);
  at::Tensor logits = model.forward(tokens);
  EXPECT_EQ(logits.scalar_type(), at::kFloat);  // the head's output is returned in fp32
  at::Tensor bf16_loss = cross_entropy(logits, targets);
  bf16_loss.backward();
  // bf16 has 8 bits of mantissa: the loss of ~7.4 agrees to a few hundredths.
  EXPECT_NEAR(bf16_loss.item<double>(), fp32_loss.item<double>(), 0.05);
  EXPECT_EQ(model.block(0).wq.grad().scalar_type(), at::kFloat);
}

TEST(ChunkedLoss, EqualsTheWholeLossAndGradients) {
  // 37 tokens, a vocabulary of 50: chunks of 1, 7 (uneven last chunk), exactly all, and more than
  // all, against PyTorch's cross-entropy of the whole fp32 (float64) logits and its autograd. A
  // backward scale of 0.25 stands for gradient accumulation. Tolerances: float64 to 1e-12; fp32
  // to 1e-5 (summation order); bf16 to 2% of each gradient's norm (both sides round products to
  // 8 bits, the chunked side sums the weight's gradient over chunks in fp32).
  const int64_t N = 37, D = 16, V = 50;
  for (const auto dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const double tol = dtype == at::kDouble ? 1e-12 : dtype == at::kFloat ? 1e-5 : 2e-2;
    at::manual_seed(5);
    const at::Tensor x0 = at::randn({N, D}, at::kDouble).to(dtype);
    const at::Tensor w0 = (at::randn({V, D}, at::kDouble) * 0.5).to(dtype);
    const at::Tensor targets = at::randint(0, V, {N}, at::kLong);
    const auto logits_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;

    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor want = cross_entropy(at::linear(x, w).to(logits_dtype), targets);
    (want * 0.25).backward();
    for (int64_t chunk : {int64_t{1}, int64_t{7}, N, N + 5}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk));
      at::Tensor xc = x0.clone().requires_grad_(true), wc = w0.clone().requires_grad_(true);
      at::Tensor got = chunked_cross_entropy(xc, wc, targets, chunk);
      EXPECT_EQ(got.scalar_type(), logits_dtype);
      EXPECT_NEAR(got.item<double>(), want.item<double>(), (dtype == at::kBFloat16 ? 1e-5 : tol) * want.item<double>());
      (got * 0.25).backward();
      ASSERT_EQ(xc.grad().scalar_type(), dtype);
      ASSERT_EQ(wc.grad().scalar_type(), dtype);
      for (const auto& [g, r] : {std::pair{xc.grad(), x.grad()}, std::pair{wc.grad(), w.grad()}})
        EXPECT_LE((g.to(at::kDouble) - r.to(at::kDouble)).norm().item<double>(),
                  tol * r.to(at::kDouble).norm().item<double>());
    }
  }
  // Without grad mode: the loss alone.
  at::NoGradGuard no_grad;
  at::Tensor x = at::randn({N, D}).requires_grad_(true), w = at::randn({V, D}).requires_grad_(true);
  at::Tensor targets = at::randint(0, V, {N}, at::kLong);
  at::Tensor loss = chunked_cross_entropy(x, w, targets, 8);
  EXPECT_FALSE(loss.requires_grad());
  EXPECT_NEAR(loss.item<double>(), cross_entropy(at::linear(x, w), targets).item<double>(), 1e-5);
}

TEST(Model, LossEqualsTheCrossEntropyOfItsLogits) {
  // Llama::loss (chunked head and loss) against cross_entropy(forward()) (whole logits): the same
  // loss and the same gradient for every parameter within fp32 summation order.
  at::manual_seed(6);
  ModelArgs a = llama2("debugmodel", 1024);
  a.max_seq_len = 16;
  Llama model(a, at::TensorOptions());
  model.init_weights();
  at::Tensor tokens = at::randint(3, 1024, {2, 16}, at::kLong);
  at::Tensor targets = at::randint(3, 1024, {2, 16}, at::kLong);
  at::Tensor want = cross_entropy(model.forward(tokens), targets);
  want.backward();
  std::vector<at::Tensor> want_grads;
  for (auto& p : model.parameter_tensors()) {
    want_grads.push_back(p.grad().clone());
    p.mutable_grad().reset();
  }
  at::Tensor got = model.loss(tokens, targets);
  got.backward();
  EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-6 * want.item<double>());
  const auto params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_LE((params[i].slot->grad() - want_grads[i]).norm().item<double>(), 1e-5 * want_grads[i].norm().item<double>())
        << params[i].name;
}

TEST(Model, DebugModelOverfitsOneBatch) {
  // The debug model (dim 256, 2 blocks, vocab 1024) memorises 4 random sequences of 64 tokens:
  // the loss falls from ~7.4 (chance is ln 1024 = 6.93) to below 0.1 within 300 AdamW steps.
  at::manual_seed(4);
  ModelArgs a = llama2("debugmodel", 1024);
  a.max_seq_len = 64;
  Llama model(a, at::TensorOptions());
  model.init_weights();
  at::Tensor rows = at::randint(3, 1024, {4, 65}, at::kLong);
  at::Tensor inputs = rows.slice(1, 0, 64), targets = rows.slice(1, 1, 65);
  AdamW opt;
  AdamWHyper hyper;
  hyper.lr = 3e-3;
  opt.add_group("all", hyper, model.parameter_tensors());
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    at::Tensor loss = cross_entropy(model.forward(inputs), targets);
    loss.backward();
    opt.step(1.0);
    for (auto& p : model.parameter_tensors()) p.mutable_grad().reset();
    (step == 0 ? first : last) = loss.item<double>();
    if (last > 0 && last < 0.1) break;
  }
  EXPECT_GT(first, 6.9);
  EXPECT_LT(last, 0.1);
}

TEST(ModelArgsJson, MixtureOfExpertsKeysRoundTripAndADenseModelWritesNone) {
  ModelArgs a = lookup_model_args("llama3", "1B");
  EXPECT_EQ(model_args_to_json(a).count("num_experts"), 0u);  // a dense model's meta.json is unchanged
  a.num_experts = 64, a.top_k = 6, a.moe_inter_dim = 1408, a.num_shared_experts = 2, a.n_dense_layers = 1;
  a.score_func = "sigmoid", a.route_norm = true, a.route_scale = 2.5, a.num_expert_groups = 8, a.num_limited_groups = 3;
  a.load_balance_coeff = 1e-3, a.aux_loss_coeff = 1e-4;
  const ModelArgs b = model_args_from_json(nlohmann::json::parse(model_args_to_json(a).dump()));
  EXPECT_EQ(b.num_experts, 64);
  EXPECT_EQ(b.top_k, 6);
  EXPECT_EQ(b.moe_inter_dim, 1408);
  EXPECT_EQ(b.num_shared_experts, 2);
  EXPECT_EQ(b.n_dense_layers, 1);
  EXPECT_EQ(b.score_func, "sigmoid");
  EXPECT_TRUE(b.route_norm);
  EXPECT_DOUBLE_EQ(b.route_scale, 2.5);
  EXPECT_EQ(b.num_expert_groups, 8);
  EXPECT_EQ(b.num_limited_groups, 3);
  EXPECT_DOUBLE_EQ(b.load_balance_coeff, 1e-3);
  EXPECT_DOUBLE_EQ(b.aux_loss_coeff, 1e-4);
  nlohmann::json bad = model_args_to_json(a);
  bad["score_func"] = 1;
  try {
    model_args_from_json(bad);
    ADD_FAILURE() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "model_args: key 'score_func' is not a string");
  }
}

TEST(ModelSizes, MixtureOfExpertsCountsItsActiveParameters) {
  // 4 blocks, the first dense; 8 experts of width 64, top 2, one shared expert: per MoE block the
  // gate 8 x 32, the experts 8 x 3 x 64 x 32, the shared SwiGLU 3 x 64 x 32.
  ModelArgs a;
  a.dim = 32, a.n_layers = 4, a.n_heads = 4, a.n_kv_heads = 4, a.vocab_size = 100, a.multiple_of = 32;
  a.num_experts = 8, a.top_k = 2, a.moe_inter_dim = 64, a.num_shared_experts = 1, a.n_dense_layers = 1;
  const int64_t attention = 4 * 32 * 32, norms = 2 * 32, dense = 3 * a.ffn_hidden() * 32;
  const int64_t gate = 8 * 32, experts = 8 * 3 * 64 * 32, shared = 3 * 64 * 32;
  const int64_t total = 2 * 100 * 32 + 32 + 4 * (attention + norms) + dense + 3 * (gate + experts + shared);
  EXPECT_EQ(count_params(a), total);
  EXPECT_EQ(count_active_params(a), total - 100 * 32 - 3 * 6 * 3 * 64 * 32);  // 6 of 8 experts idle
  Llama model(a, at::TensorOptions().device(at::kMeta));
  EXPECT_EQ(model.num_params(), total);
  std::vector<std::string> names;
  for (const auto& p : model.parameters())
    if (p.layer == 1) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"layers.1.attention.wq.weight", "layers.1.attention.wk.weight",
                                             "layers.1.attention.wv.weight", "layers.1.attention.wo.weight",
                                             "layers.1.moe.router.gate.weight", "layers.1.moe.experts.w1",
                                             "layers.1.moe.experts.w2", "layers.1.moe.experts.w3",
                                             "layers.1.moe.shared_experts.w1.weight",
                                             "layers.1.moe.shared_experts.w2.weight",
                                             "layers.1.moe.shared_experts.w3.weight",
                                             "layers.1.attention_norm.weight", "layers.1.ffn_norm.weight"}));
}
