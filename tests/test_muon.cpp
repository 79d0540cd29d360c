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
  for (const char* coefficients : {"jordan", "polar_express"})
    for (auto shape : {std::vector<int64_t>{48, 64}, {64, 48}, {3, 32, 40}}) {
      const NsCoefficients& k = ns_coefficients(coefficients);
      at::Tensor G = at::randn(shape, at::kDouble);
      at::Tensor exact = newton_schulz(G, 5, at::kDouble, 1e-7, true, k);
      at::Tensor fp32 = newton_schulz(G.to(at::kFloat), 5, at::kFloat, 1e-7, true, k);
      EXPECT_EQ(fp32.scalar_type(), at::kFloat);
      // Polar Express's first step (a = 8.16, c = 15.9) amplifies fp32's rounding a few times more.
      const double tolerance = k.name == "jordan" ? 1e-6 : 4e-6;
      EXPECT_LE(max_abs(fp32.to(at::kDouble) - exact), tolerance) << G.sizes() << " " << coefficients;
    }
}

// The coefficients against float64 SVD, on the debug and 150M presets' shapes (wq 256², w1
// 768 x 256, wq 1024²; 150M's w1, 2816 x 1024, would add 10 s on this machine's two cores): U diag(s) Vᵀ with U, V random orthogonal and s log-spaced
// over 1.5 decades. Newton-Schulz acts on each singular value alone, so the result's singular values
// are the steps' scalar polynomials applied to s / (||s|| · safety), which the test computes itself
// (to 1e-9; 7 steps on the smallest: past Polar Express's 5-step table, its last step again). After 5 steps
// polar_express holds every one within 0.15 of 1 and jordan within [0.5, 1.5], its spread the wider.
TEST(Muon, NewtonSchulzCoefficientsAgainstTheSvd) {
  at::manual_seed(5);
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{256, 256}, {768, 256}, {1024, 1024}}) {
    const int64_t n = std::min(rows, cols);
    const at::Tensor U = std::get<0>(at::linalg_qr(at::randn({rows, n}, at::kDouble)));
    const at::Tensor V = std::get<0>(at::linalg_qr(at::randn({cols, n}, at::kDouble)));
    const at::Tensor s = at::logspace(-1.5, 0, n, 10.0, at::kDouble);
    const at::Tensor G = U.mul(s).matmul(V.mT());
    double worst[2] = {0, 0};
    for (const char* name : {"jordan", "polar_express"}) {
      const NsCoefficients& k = ns_coefficients(name);
      for (const int64_t steps : rows == 256 ? std::vector<int64_t>{5, 7} : std::vector<int64_t>{5}) {
        std::vector<double> want;
        const double norm = s.norm().item<double>() * k.safety;
        for (int64_t i = 0; i < n; ++i) {
          double x = s[i].item<double>() / norm;
          for (int64_t j = 0; j < steps; ++j) {
            const auto& [a, b, c] = k.step(j);
            x = a * x + b * x * x * x + c * x * x * x * x * x;
          }
          want.push_back(x);
        }
        std::sort(want.begin(), want.end());
        const at::Tensor got = std::get<0>(at::sort(at::linalg_svdvals(newton_schulz(G, steps, at::kDouble, 1e-7, true, k))));
        EXPECT_LE(max_abs(got - at::tensor(want, at::kDouble)), 1e-9) << rows << "x" << cols << " " << name << " " << steps;
        if (steps != 5) continue;
        const double low = got.min().item<double>(), high = got.max().item<double>();
        if (k.name == "polar_express") {
          EXPECT_GE(low, 0.85) << rows << "x" << cols;
          EXPECT_LE(high, 1.15) << rows << "x" << cols;
        } else {
          EXPECT_GE(low, 0.5) << rows << "x" << cols;
          EXPECT_LE(high, 1.5) << rows << "x" << cols;
        }
        worst[k.name == "polar_express"] = std::max(1 - low, high - 1);
      }
    }
    EXPECT_LT(worst[1], worst[0]) << rows << "x" << cols;
  }
}

TEST(Muon, BatchedNewtonSchulzEqualsOneByOne) {
  at::manual_seed(1);
  at::Tensor G = at::randn({4, 24, 40}, at::kDouble);
  at::Tensor batched = newton_schulz(G, 5, at::kDouble);
  for (int64_t k = 0; k < 4; ++k)
    EXPECT_LE(max_abs(batched[k] - newton_schulz(G[k], 5, at::kDouble)), 1e-12);
}

// Gram Newton-Schulz (optim.optim.ns_algorithm = "gram") is the same polynomial in X Xᵀ, so in
// float64 it equals the standard iteration to rounding, whichever steps it restarts before (none,
// each set's own, others): wide, tall, a batch; both coefficient sets. In fp32, within a few times
// standard fp32's distance from float64.
TEST(GramNewtonSchulz, EqualsTheStandardIterationInFloat64) {
  at::manual_seed(6);
  for (const char* name : {"jordan", "polar_express"})
    for (auto shape : {std::vector<int64_t>{40, 120}, {120, 40}, {3, 24, 64}}) {
      const NsCoefficients& k = ns_coefficients(name);
      const at::Tensor G = at::randn(shape, at::kDouble);
      const at::Tensor want = newton_schulz(G, 5, at::kDouble, 1e-7, true, k);
      for (const auto& restarts : std::vector<std::optional<std::vector<int64_t>>>{std::nullopt, std::vector<int64_t>{},
                                                                                 std::vector<int64_t>{1, 2, 3, 4}}) {
        const at::Tensor got = gram_newton_schulz(G, 5, at::kDouble, 1e-7, true, k, restarts);
        EXPECT_EQ(got.sizes(), G.sizes());
        EXPECT_LE(max_abs(got - want), 1e-10) << G.sizes() << " " << name;
      }
      const double standard_fp32 = max_abs(newton_schulz(G.to(at::kFloat), 5, at::kFloat, 1e-7, true, k).to(at::kDouble) - want);
      const at::Tensor gram_fp32 = gram_newton_schulz(G.to(at::kFloat), 5, at::kFloat, 1e-7, true, k);
      EXPECT_EQ(gram_fp32.scalar_type(), at::kFloat);
      EXPECT_LE(max_abs(gram_fp32.to(at::kDouble) - want), std::max(20 * standard_fp32, 1e-5)) << G.sizes() << " " << name;
    }
}

// In fp16 (the dtype its authors iterate in, and ours on a GPU) against float64 SVD, on the debug
// preset's w1 shape (transposed: 256 x 768) with singular values over 3 decades (U diag(s) Vᵀ): the
// result's sorted singular values lie within 0.03 of the float64 iteration's, for both coefficient
// sets with their own restarts (measured here: 0.006 for jordan, 0.004 for polar_express). Without
// restarts fp16's rounding compounds in Q: 0.07 and 0.85 off; polar_express restarted only where
// jordan is (before step 2) is off too.
TEST(GramNewtonSchulz, Fp16WithItsRestartsAgainstTheSvd) {
  at::manual_seed(7);
  const int64_t m = 256, n = 768;
  const at::Tensor U = std::get<0>(at::linalg_qr(at::randn({m, m}, at::kDouble)));
  const at::Tensor V = std::get<0>(at::linalg_qr(at::randn({n, m}, at::kDouble)));
  const at::Tensor s = at::logspace(-3, 0, m, 10.0, at::kDouble);
  const at::Tensor G = U.mul(s).matmul(V.mT());
  const auto singular_values = [](const at::Tensor& X) {
    return std::get<0>(at::sort(at::linalg_svdvals(X.to(at::kDouble))));
  };
  for (const char* name : {"jordan", "polar_express"}) {
    const NsCoefficients& k = ns_coefficients(name);
    const at::Tensor exact = singular_values(newton_schulz(G, 5, at::kDouble, 1e-7, true, k));
    const at::Tensor fp16 = gram_newton_schulz(G, 5, at::kHalf, 1e-7, true, k);
    EXPECT_EQ(fp16.scalar_type(), at::kHalf);
    const double restarted = max_abs(singular_values(fp16) - exact);
    const double unrestarted =
        max_abs(singular_values(gram_newton_schulz(G, 5, at::kHalf, 1e-7, true, k, std::vector<int64_t>{})) - exact);
    std::printf("%s: fp16 Gram Newton-Schulz's singular values within %.4f of float64's (%.4f without restarts)\n",
                name, restarted, unrestarted);
    EXPECT_LE(restarted, 0.03) << name;
    EXPECT_GT(unrestarted, 2 * restarted) << name;
    if (k.name != "polar_express") continue;
    // Jordan's single restart (before step 2) does not hold Polar Express's steps.
    const double jordans =
        max_abs(singular_values(gram_newton_schulz(G, 5, at::kHalf, 1e-7, true, k, std::vector<int64_t>{2})) - exact);
    std::printf("  restarted before step 2 only: within %.4f\n", jordans);
    EXPECT_GT(jordans, 2 * restarted);
  }
}

// What "gram" takes: the multiply-add counts (5 steps; X m x n, m the short side: standard
// 10 m²n + 5 m³, Gram 4 m²n + 14 m³ restarted once, 6 m²n + 11 m³ twice) decide, so a square
// matrix and one 1.5 times as long as wide stay standard; Muon then gives a gram matrix's update
// gram_newton_schulz's bits and a square one newton_schulz's.
TEST(GramNewtonSchulz, TakesTheMatricesWhereItCountsFewerMultiplyAdds) {
  for (const char* name : {"jordan", "polar_express"}) {
    const NsCoefficients& k = ns_coefficients(name);
    EXPECT_FALSE(gram_newton_schulz_pays(256, 256, 5, k)) << name;
    EXPECT_FALSE(gram_newton_schulz_pays(384, 256, 5, k)) << name;
    EXPECT_TRUE(gram_newton_schulz_pays(256, 400, 5, k)) << name;
    EXPECT_TRUE(gram_newton_schulz_pays(768, 256, 5, k)) << name;
  }
  const double m = 256, n = 768;
  EXPECT_DOUBLE_EQ(newton_schulz_multiply_adds(768, 256, 5), 10 * m * m * n + 5 * m * m * m);
  EXPECT_DOUBLE_EQ(gram_newton_schulz_multiply_adds(768, 256, 5, {2}), 4 * m * m * n + 14 * m * m * m);
  EXPECT_DOUBLE_EQ(gram_newton_schulz_multiply_adds(256, 768, 5, {1, 3}), 6 * m * m * n + 11 * m * m * m);

  // In 16 bits (bf16 standard, fp16 Gram) the two results differ by far more than the update's
  // fp32 rounding, so each parameter shows which ran.
  at::manual_seed(8);
  MuonHyper h;
  h.ns_dtype = at::kBFloat16;
  h.ns_algorithm = "gram";
  h.weight_decay = 0;
  Muon muon(h);
  const NsCoefficients& k = ns_coefficients(h.ns_coefficients);
  for (const auto& [rows, cols, gram] : std::vector<std::tuple<int64_t, int64_t, bool>>{{32, 32, false}, {32, 96, true}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    at::Tensor p = at::zeros({rows, cols}).requires_grad_(true);
    muon.params().clear();
    muon.add_param("w", p);
    const at::Tensor g = at::randn({rows, cols});
    p.mutable_grad() = g.clone();
    muon.step(1.0);
    const at::Tensor update = -p.detach() / (h.lr * muon_update_scale("original", rows, cols));
    // The first step's input: the momentum buffer's lerp from zero, then Nesterov's lerp.
    const at::Tensor input = at::lerp(g, at::lerp(at::zeros_like(g), g, 1 - h.momentum), h.momentum);
    const at::Tensor standard = newton_schulz(input, 5, at::kBFloat16, 1e-7, true, k).to(at::kFloat);
    // Muon stacks its inputs in ns_dtype before either algorithm reads them.
    const at::Tensor gram_result =
        gram_newton_schulz(input.to(at::kBFloat16), 5, at::kHalf, 1e-7, true, k).to(at::kBFloat16).to(at::kFloat);
    EXPECT_GT(max_abs(standard - gram_result), 1e-3);
    EXPECT_LE(max_abs(update - (gram ? gram_result : standard)), 1e-5);
  }
  MuonHyper unknown;
  unknown.ns_algorithm = "grams";
  EXPECT_THROW(Muon{unknown}, std::invalid_argument);
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
