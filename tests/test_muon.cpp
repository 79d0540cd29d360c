// Muon and AdamW against PyTorch's own optimizers (torch.optim.Muon / torch.optim.AdamW, run in
// Python by tests/reference/optim_reference.py), Newton-Schulz against float64, and a check that
// the update really is orthogonalised; in one process (over ranks: tests/test_muon_ranks.cpp).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include "optim/adamw.h"
#include "optim/muon.h"
#include "muon_cases.h"
#include "reference_data.h"

using namespace zb;

namespace {
double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }
}  // namespace

TEST(Muon, MatchesTorchOptimMuon) {
  const auto ref = reference::run_reference("optim_reference.py", "muon");
  run_muon_cases(ref, [&](const std::string& c, const std::string& s, const MuonHyper& h, double lr_scale,
                          const at::Tensor& before, at::Tensor& p, Muon& muon) {
    // Momentum is plain fp32 arithmetic: the same values as PyTorch's.
    const at::Tensor& want_m = ref[c + "/momentum" + s];
    EXPECT_LE(max_abs(muon.params()[0].momentum_buffer - want_m), 1e-7 * max_abs(want_m)) << c;
    // The parameter: Newton-Schulz runs in bf16 (8-bit mantissa) on both sides, with fused
    // multiply-adds on both; the orthogonalised update O has entries of order 0.1-1, and we allow
    // 1% of its largest entry, times lr*scale.
    const at::Tensor& want_p = ref[c + "/param" + s];
    at::Tensor want_update = (before * (1 - h.lr * h.weight_decay) - want_p) / lr_scale;
    at::Tensor got_update = (before * (1 - h.lr * h.weight_decay) - p.detach()) / lr_scale;
    EXPECT_LE(max_abs(got_update - want_update), 1e-2 * max_abs(want_update)) << c << " step " << s;
    EXPECT_LE(max_abs(p.detach() - want_p), 1e-2 * lr_scale * max_abs(want_update)) << c;
  });
}


TEST(Muon, Fp32NewtonSchulzMatchesFloat64) {
  at::manual_seed(0);
  for (auto shape : {std::vector<int64_t>{48, 64}, {64, 48}, {3, 32, 40}}) {
    at::Tensor G = at::randn(shape, at::kDouble);
    at::Tensor exact = newton_schulz(G, 5, at::kDouble);
    at::Tensor fp32 = newton_schulz(G.to(at::kFloat), 5, at::kFloat);
    EXPECT_EQ(fp32.scalar_type(), at::kFloat);
    EXPECT_LE(max_abs(fp32.to(at::kDouble) - exact), 1e-6) << G.sizes();
  }
}

TEST(Muon, BatchedNewtonSchulzEqualsOneByOne) {
  at::manual_seed(1);
  at::Tensor G = at::randn({4, 24, 40}, at::kDouble);
  at::Tensor batched = newton_schulz(G, 5, at::kDouble);
  for (int64_t k = 0; k < 4; ++k)
    EXPECT_LE(max_abs(batched[k] - newton_schulz(G[k], 5, at::kDouble)), 1e-12);
}

TEST(Muon, UpdateIsOrthogonalised) {
  // A gradient whose singular values spread over two decades; Muon's update must have them all
  // near 1 (Keller's coefficients leave them in about [0.7, 1.2]). Without orthogonalisation the
  // update would keep the gradient's spread and fail this test.
  at::manual_seed(2);
  const int64_t m = 64, n = 96;
  at::Tensor U = std::get<0>(at::linalg_qr(at::randn({m, m}, at::kDouble)));
  at::Tensor V = std::get<0>(at::linalg_qr(at::randn({n, m}, at::kDouble)));
  at::Tensor s = at::logspace(0, -2, m, 10.0, at::kDouble);
  at::Tensor G = (U * s) .matmul(V.t()).to(at::kFloat);
  at::Tensor g_sv = at::linalg_svdvals(G);
  ASSERT_GT((g_sv.max() / g_sv.min()).item<double>(), 50.0);

  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    MuonHyper h;
    h.lr = 0.1;
    h.weight_decay = 0.0;
    h.ns_dtype = dtype;
    Muon muon(h);
    at::Tensor p = at::zeros({m, n}).requires_grad_(true);
    muon.add_param("w", p);
    p.mutable_grad() = G.clone();
    muon.step(1.0);
    at::Tensor update = -p.detach() / (h.lr * muon_update_scale("original", m, n));
    at::Tensor sv = at::linalg_svdvals(update);
    EXPECT_GT(sv.min().item<double>(), 0.5) << dtype;
    EXPECT_LT(sv.max().item<double>(), 1.5) << dtype;
    EXPECT_EQ(muon.matrices_orthogonalized(), 1);  // once per matrix per step
  }
}

TEST(Muon, ZeroGradientGivesZeroUpdateAndSkipsMissingGrads) {
  Muon muon(MuonHyper{});
  at::Tensor a = at::ones({8, 8}).requires_grad_(true), b = at::ones({8, 4}).requires_grad_(true);
  muon.add_param("a", a);
  muon.add_param("b", b);
  a.mutable_grad() = at::zeros({8, 8});
  muon.step(1.0);
  EXPECT_FALSE(at::isnan(a).any().item<bool>());
  EXPECT_NEAR(a.detach().mean().item<double>(), 1 - 0.02 * 0.01, 1e-7);  // decay only
  EXPECT_TRUE(at::equal(b.detach(), at::ones({8, 4})));                  // no grad: untouched
  EXPECT_EQ(muon.matrices_orthogonalized(), 1);
}

TEST(AdamW, MatchesTorchOptimAdamW) {
  const auto ref = reference::run_reference("optim_reference.py", "adamw");
  const int steps = ref.manifest["steps"];
  std::vector<at::Tensor> params;
  for (int i = 0; i < 3; ++i)
    params.push_back(ref["p" + std::to_string(i) + "/param0"].clone().requires_grad_(true));
  AdamW opt;
  opt.add_group("all", {0.01, 0.8, 0.95, 1e-10, 0.01}, params);
  for (int s = 1; s <= steps; ++s) {
    for (int i = 0; i < 3; ++i)
      params[i].mutable_grad() = ref["p" + std::to_string(i) + "/grad" + std::to_string(s)].clone();
    opt.step(static_cast<double>(s) / steps);
    for (int i = 0; i < 3; ++i) {
      const at::Tensor& want = ref["p" + std::to_string(i) + "/param" + std::to_string(s)];
      // <= 1e-6 relative to the parameter's magnitude.
      EXPECT_LE(max_abs(params[i].detach() - want), 1e-6 * max_abs(want)) << "p" << i << " step " << s;
    }
  }
}

TEST(Muon, ExpertStacksAreOrthogonalisedExpertByExpert) {
  // A mixture of experts' [E, rows, cols]: each expert's matrix on its own, as a loop over 2-D
  // parameters steps them, and not the stack flattened into one [E rows, cols] matrix.
  at::manual_seed(4);
  const int64_t E = 3, rows = 24, cols = 16;
  MuonHyper h;
  h.ns_dtype = at::kFloat;
  Muon stacked(h), apart(h);
  at::Tensor stack = (at::randn({E, rows, cols}) * 0.1).requires_grad_(true);
  stacked.add_param("experts.w1", stack);
  std::vector<at::Tensor> experts;
  for (int64_t e = 0; e < E; ++e) {
    experts.push_back(stack.detach()[e].clone().requires_grad_(true));
    apart.add_param("expert" + std::to_string(e), experts.back());
  }
  for (int step = 0; step < 3; ++step) {
    const at::Tensor grad = at::randn({E, rows, cols});
    stack.mutable_grad() = grad.clone();
    for (int64_t e = 0; e < E; ++e) experts[e].mutable_grad() = grad[e].clone();
    stacked.step(1.0);
    apart.step(1.0);
  }
  for (int64_t e = 0; e < E; ++e) EXPECT_LE(max_abs(stack.detach()[e] - experts[e].detach()), 1e-6) << e;
  EXPECT_EQ(stacked.matrices_orthogonalized(), 3 * E);
  // The flattened stack's orthogonalisation is another update.
  const at::Tensor g = at::randn({E, rows, cols});
  const at::Tensor each = newton_schulz(g, 5, at::kFloat);
  const at::Tensor flat = newton_schulz(g.reshape({E * rows, cols}), 5, at::kFloat).view({E, rows, cols});
  EXPECT_GT(max_abs(each - flat), 0.05);
  // The update scale is one expert's: sqrt(rows / cols), not sqrt(E rows / cols).
  // (A first step from zero: the momentum's input is a multiple of g, which the normalisation undoes.)
  h.weight_decay = 0;
  Muon one(h);
  at::Tensor p = at::zeros({E, rows, cols}).requires_grad_(true);
  one.add_param("p", p);
  p.mutable_grad() = g.clone();
  one.step(1.0);
  const at::Tensor expected = -h.lr * std::sqrt(static_cast<double>(rows) / cols) * each;
  EXPECT_LE(max_abs(p.detach() - expected), 1e-5);
}
