// The model's building blocks against float64 formulas written out element by element.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <cmath>
#include <complex>

#include "model/attention.h"
#include "model/layers.h"

using namespace zb;

namespace {
at::Tensor randn64(at::IntArrayRef shape) { return at::randn(shape, at::kDouble); }
double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}
}  // namespace

TEST(Layers, RopeMatchesComplexFormulation) {
  at::manual_seed(0);
  const int64_t B = 2, T = 7, H = 3, Dh = 8;
  const double theta = 10000.0;
  at::Tensor x = at::randn({B, T, H, Dh}, at::kFloat);
  at::Tensor got = apply_rope(x, rope_tables(Dh, 2 * T, theta, at::kFloat));

  at::Tensor x64 = x.to(at::kDouble);
  auto xa = x64.accessor<double, 4>();
  at::Tensor want = at::empty_like(x64);
  auto wa = want.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Dh / 2; ++i) {
          const double freq = std::pow(theta, -2.0 * i / Dh);
          std::complex<double> z(xa[b][t][h][2 * i], xa[b][t][h][2 * i + 1]);
          std::complex<double> r = z * std::polar(1.0, t * freq);
          wa[b][t][h][2 * i] = r.real();
          wa[b][t][h][2 * i + 1] = r.imag();
        }
  // fp32 tables and arithmetic, as ZeroBand: within a few fp32 ulps of values of order 1.
  EXPECT_LT(max_abs_diff(got, want), 1e-5);
  // And in float64 end to end, to float64 rounding.
  at::Tensor got64 = apply_rope(x64, rope_tables(Dh, 2 * T, theta, at::kDouble));
  EXPECT_LT(max_abs_diff(got64, want), 1e-12);
}

TEST(Layers, CausalGqaAttentionMatchesNaiveSoftmax) {
  at::manual_seed(1);
  const int64_t B = 2, T = 9, H = 6, Hkv = 2, Dh = 16;
  for (int64_t kv : {Hkv, H}) {  // grouped-query and plain multi-head
    at::Tensor q = randn64({B, T, H, Dh}), k = randn64({B, T, kv, Dh}), v = randn64({B, T, kv, Dh});
    at::Tensor got = attention(q, k, v);  // [B, T, H*Dh]

    auto qa = q.accessor<double, 4>(), ka = k.accessor<double, 4>(), va = v.accessor<double, 4>();
    at::Tensor want = at::zeros({B, T, H * Dh}, at::kDouble);
    auto oa = want.accessor<double, 3>();
    const int64_t group = H / kv;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t hk = h / group;  // query head h reads key/value head h / group
        for (int64_t i = 0; i < T; ++i) {
          std::vector<double> s(i + 1);
          double mx = -1e300;
          for (int64_t j = 0; j <= i; ++j) {  // causal: keys up to the query's position
            double dot = 0;
            for (int64_t d = 0; d < Dh; ++d) dot += qa[b][i][h][d] * ka[b][j][hk][d];
            s[j] = dot / std::sqrt(static_cast<double>(Dh));
            mx = std::max(mx, s[j]);
          }
          double z = 0;
          for (auto& e : s) z += (e = std::exp(e - mx));
          for (int64_t d = 0; d < Dh; ++d) {
            double acc = 0;
            for (int64_t j = 0; j <= i; ++j) acc += s[j] / z * va[b][j][hk][d];
            oa[b][i][h * Dh + d] = acc;
          }
        }
      }
    EXPECT_LT(max_abs_diff(got, want), 1e-12) << "kv heads " << kv;
  }
}

TEST(Layers, RmsNormMatchesFormula) {
  at::manual_seed(2);
  const int64_t N = 5, D = 12;
  const double eps = 1e-5;
  at::Tensor x = randn64({N, D}), w = randn64({D});
  at::Tensor got = rms_norm(x, w, eps);
  auto xa = x.accessor<double, 2>();
  auto wa = w.accessor<double, 1>();
  at::Tensor want = at::empty_like(x);
  auto oa = want.accessor<double, 2>();
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t d = 0; d < D; ++d) ms += xa[n][d] * xa[n][d];
    const double r = 1.0 / std::sqrt(ms / D + eps);
    for (int64_t d = 0; d < D; ++d) oa[n][d] = xa[n][d] * r * wa[d];
  }
  EXPECT_LT(max_abs_diff(got, want), 1e-12);
  // fp32 input: same formula to fp32 precision.
  EXPECT_LT(max_abs_diff(rms_norm(x.to(at::kFloat), w.to(at::kFloat), eps), want), 1e-5);
}

TEST(Layers, RmsNormResidualNodeGivesAutogradsGradients) {
  // The norm that hands its input on to the residual stream (rms_norm_residual_node: on a GPU its
  // backward adds the residual's gradient inside our kernel) used as a block uses it, h2 = h' + o
  // and y = rms_norm(h), against the plain graph (autograd adds h's two gradients itself). float64
  // through the node's own formula: every gradient within 1e-12; y and h' equal to the plain ones.
  // Then without a residual use of h' (the final norm), and with y unused (only the residual's
  // gradient comes back).
  at::manual_seed(12);
  const at::Tensor h0 = randn64({2, 5, 16}) * 3, w0 = at::rand({16}, at::kDouble) + 0.5, o = randn64({2, 5, 16});
  const at::Tensor c1 = randn64({2, 5, 16}), c2 = randn64({2, 5, 16});
  for (const int uses : {3, 2, 1}) {  // bit 1: y used, bit 2: h' used
    auto grads = [&](bool node) {
      at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      auto [h_on, y] = node ? rms_norm_residual_node(h, w, 1e-5) : std::pair{h, rms_norm(h, w, 1e-5)};
      EXPECT_TRUE(at::equal(h_on, h0));
      at::Tensor loss = at::zeros({}, at::kDouble);
      if (uses & 1) loss = loss + (c2 * y).sum();
      if (uses & 2) loss = loss + (c1 * (h_on + o)).sum();
      loss.backward();
      return std::vector<at::Tensor>{y.detach(), h.grad(), w.grad().defined() ? w.grad() : at::zeros_like(w0)};
    };
    const auto got = grads(true), want = grads(false);
    EXPECT_LT(max_abs_diff(got[0], want[0]), 1e-12) << "y, uses " << uses;
    EXPECT_LT(max_abs_diff(got[1], want[1]), 1e-12) << "dh, uses " << uses;
    EXPECT_LT(max_abs_diff(got[2], want[2]), 1e-12) << "dw, uses " << uses;
    EXPECT_GT(want[1].abs().max().item<double>(), 0.1) << "a gradient to compare, uses " << uses;
  }
  // In bf16 on the CPU the node gives the plain graph's gradients within one bf16 step of their
  // size (its fp32 formula rounds once where the plain graph rounds each operator).
  const at::Tensor hb = h0.to(at::kBFloat16), wb = w0.to(at::kFloat);
  auto bf16_grads = [&](bool node) {
    at::Tensor h = hb.clone().requires_grad_(true), w = wb.clone().requires_grad_(true);
    auto [h_on, y] = node ? rms_norm_residual_node(h, w, 1e-5) : std::pair{h, rms_norm(h, w, 1e-5)};
    ((c2.to(at::kBFloat16) * y).sum() + (c1.to(at::kBFloat16) * (h_on + o.to(at::kBFloat16))).sum()).backward();
    return std::vector<at::Tensor>{h.grad().to(at::kDouble), w.grad().to(at::kDouble)};
  };
  const auto got = bf16_grads(true), want = bf16_grads(false);
  for (int i = 0; i < 2; ++i)
    EXPECT_LT(max_abs_diff(got[i], want[i]), 4 * std::ldexp(1.0, -8) * want[i].abs().max().item<double>())
        << (i == 0 ? "dh" : "dw") << " in bf16";
}

TEST(Layers, ResidualLinearIsOneGemmWithAutogradsGradients) {
  // h + x w^T as one GEMM node (the GPU's form, taken here on the CPU through the test hook, where
  // its GEMM is addmm) against at::linear then the add: float64 within 1e-12, values and the
  // gradients of h, x and w; and our node, or the add's.
  at::manual_seed(16);
  const at::Tensor h0 = randn64({2, 5, 8}), x0 = randn64({2, 5, 12}), w0 = randn64({8, 12});
  auto run = [&](bool one_gemm) {
    KernelChoices kernels;
    kernels.nodes_on_any_device = one_gemm;
    at::Tensor h = h0.clone().requires_grad_(true), x = x0.clone().requires_grad_(true),
               w = w0.clone().requires_grad_(true);
    const at::Tensor y = residual_linear(h, x, w, kernels);
    EXPECT_EQ(y.sizes(), h0.sizes());
    const std::string node = y.grad_fn()->name();
    EXPECT_NE(node.find(one_gemm ? "ResidualLinear" : "AddBackward0"), std::string::npos) << node;
    (y * at::cos(y)).sum().backward();
    return std::vector<at::Tensor>{y.detach(), h.grad(), x.grad(), w.grad()};
  };
  const auto got = run(true), want = run(false);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(max_abs_diff(got[i], want[i]), 1e-12) << "tensor " << i;
}

TEST(Layers, SharedInputLinearsNodeGivesAutogradsGradients) {
  // The node that multiplies one input by several weights (q, k, v; the gate and up projections)
  // and sums the input's gradients inside the GEMMs, against autograd's separate linears: float64
  // within 1e-12, for three weights of different widths (a GQA block's q, k, v), for two, and
  // with one output unused (its weight gets no gradient, x the others').
  at::manual_seed(14);
  const at::Tensor x0 = randn64({2, 5, 16});
  const std::vector<at::Tensor> w0{randn64({16, 16}), randn64({8, 16}), randn64({8, 16})};
  for (const size_t n : {size_t{3}, size_t{2}})
    for (const bool all_used : {true, false}) {
      auto grads = [&](bool node) {
        at::Tensor x = x0.clone().requires_grad_(true);
        std::vector<at::Tensor> w;
        for (size_t i = 0; i < n; ++i) w.push_back(w0[i].clone().requires_grad_(true));
        std::vector<at::Tensor> y;
        if (node) y = shared_input_linears_node(x, w);
        else
          for (const at::Tensor& wi : w) y.push_back(at::linear(x, wi));
        at::Tensor loss = at::zeros({}, at::kDouble);
        for (size_t i = 0; i < n; ++i)
          if (all_used || i != 1) loss = loss + (y[i] * at::cos(y[i])).sum();
        loss.backward();
        std::vector<at::Tensor> out{x.grad()};
        for (size_t i = 0; i < n; ++i) out.push_back(w[i].grad().defined() ? w[i].grad() : at::full_like(w0[i], -7));
        for (size_t i = 0; i < n; ++i) out.push_back(y[i].detach());
        return out;
      };
      const auto got = grads(true), want = grads(false);
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_LT(max_abs_diff(got[i], want[i]), 1e-12) << n << " weights, all used " << all_used << ", tensor " << i;
      EXPECT_GT(want[0].abs().max().item<double>(), 0.1);
    }
}

TEST(Layers, EachFusedOperatorCanBeLeftToAten) {
  // runtime.unfused: the named operators off, the rest on; the gate (the one that applies on the
  // CPU) then runs as ATen's silu and mul nodes. An unknown name is an error naming the known.
  EXPECT_EQ(split_operator_names(" norm, linears,,gate "), (std::vector<std::string>{"norm", "linears", "gate"}));
  EXPECT_EQ(fused_operator_names(),
            (std::vector<std::string>{"rope", "gate", "loss", "norm", "linears", "update", "momentum", "residual",
                                      "newton_schulz"}));
  const at::Tensor a = at::randn({4}, at::kFloat).requires_grad_(true), b = at::randn({4}, at::kFloat);
  const KernelChoices some = KernelChoices::from(true, "gate, norm", "flash");
  EXPECT_FALSE(some.on(Fused::Gate));
  EXPECT_FALSE(some.on(Fused::Norm));
  EXPECT_TRUE(some.on(Fused::Rope) && some.on(Fused::Loss) && some.on(Fused::Linears));
  EXPECT_FALSE(some.cudnn_varlen);
  EXPECT_EQ(silu_mul(a, b, some).grad_fn()->name(), "MulBackward0");
  const KernelChoices all = KernelChoices::from(true, "", "cudnn");
  EXPECT_NE(silu_mul(a, b, all).grad_fn()->name(), "MulBackward0");  // our node
  EXPECT_TRUE(all.cudnn_varlen);
  EXPECT_THROW(KernelChoices::from(true, "norms", "flash"), std::invalid_argument);
  EXPECT_THROW(KernelChoices::from(true, "", "fa3"), std::invalid_argument);
  const KernelChoices none = KernelChoices::from(false, "gate", "flash");  // the names then ignored
  EXPECT_FALSE(none.on(Fused::Rope) || none.on(Fused::Gate) || none.on(Fused::Loss) || none.on(Fused::Norm) ||
               none.on(Fused::Linears));
  EXPECT_TRUE(KernelChoices{}.on(Fused::Gate));  // all by default
}

TEST(Layers, TheGpusNodesRunWithoutGradients) {
  // Evaluation runs the model under no_grad: the nodes (on a GPU in bf16) give the plain values
  // there too, and record nothing.
  at::manual_seed(16);
  const at::Tensor h = randn64({2, 3, 8}), w = at::rand({8}, at::kDouble) + 0.5, w2 = randn64({4, 8});
  at::NoGradGuard no_grad;
  const auto [h_on, y] = rms_norm_residual_node(h, w, 1e-5);
  EXPECT_TRUE(at::equal(h_on, h));
  EXPECT_LT(max_abs_diff(y, rms_norm(h, w, 1e-5)), 1e-12);
  EXPECT_FALSE(y.requires_grad());
  const std::vector<at::Tensor> out = shared_input_linears_node(h, {w2, w2 * 2});
  EXPECT_LT(max_abs_diff(out[1], at::linear(h, w2) * 2), 1e-12);
  EXPECT_FALSE(out[0].requires_grad());
}

TEST(Layers, SwiGluMatchesFormula) {
  at::manual_seed(3);
  const int64_t N = 4, D = 6, F = 10;
  at::Tensor x = randn64({N, D}), w1 = randn64({F, D}), w2 = randn64({D, F}), w3 = randn64({F, D});
  at::Tensor got = swiglu(x, w1, w2, w3);
  auto xa = x.accessor<double, 2>(), a1 = w1.accessor<double, 2>(), a2 = w2.accessor<double, 2>(),
       a3 = w3.accessor<double, 2>();
  at::Tensor want = at::zeros({N, D}, at::kDouble);
  auto oa = want.accessor<double, 2>();
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> hidden(F);
    for (int64_t f = 0; f < F; ++f) {
      double g = 0, u = 0;
      for (int64_t d = 0; d < D; ++d) g += a1[f][d] * xa[n][d], u += a3[f][d] * xa[n][d];
      hidden[f] = g / (1.0 + std::exp(-g)) * u;  // silu(g) * u
    }
    for (int64_t d = 0; d < D; ++d)
      for (int64_t f = 0; f < F; ++f) oa[n][d] += a2[d][f] * hidden[f];
  }
  EXPECT_LT(max_abs_diff(got, want), 1e-12);
}

TEST(Layers, SiluMulIsAtenSiluThenMulBitForBitInOneNode) {
  // SwiGLU's gate as one autograd node: the numbers of ATen's silu then mul (PyTorch's own
  // operators, differentiated by autograd), exactly, in every dtype the model computes in; a
  // graph with one node between a, b and the product, so that silu(a) is not kept for backward.
  at::manual_seed(5);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
    const at::Tensor a0 = at::randn({7, 37}, at::kFloat).mul(3).to(dtype), b0 = at::randn({7, 37}).to(dtype),
                     g = at::randn({7, 37}).to(dtype);
    at::Tensor a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    at::Tensor ra = a0.clone().requires_grad_(true), rb = b0.clone().requires_grad_(true);
    const at::Tensor got = silu_mul(a, b), want = at::silu(ra) * rb;
    got.backward(g);
    want.backward(g);
    EXPECT_TRUE(at::equal(got, want)) << dtype;
    EXPECT_TRUE(at::equal(a.grad(), ra.grad())) << dtype;
    EXPECT_TRUE(at::equal(b.grad(), rb.grad())) << dtype;
    ASSERT_NE(got.grad_fn()->name().find("SiluMul"), std::string::npos) << got.grad_fn()->name();
    for (const torch::autograd::Edge& edge : got.grad_fn()->next_edges())
      EXPECT_NE(edge.function->name().find("AccumulateGrad"), std::string::npos) << edge.function->name();
  }
  // What it cannot do, it says.
  const at::Tensor a = at::randn({3, 4}).requires_grad_(true), b = at::randn({3, 4}).requires_grad_(true);
  try {
    torch::autograd::grad({silu_mul(a, b)}, {a}, {at::ones({3, 4})}, /*retain_graph=*/true, /*create_graph=*/true);
    ADD_FAILURE() << "a second derivative was allowed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no second derivative"), std::string::npos) << e.what();
  }
  EXPECT_THROW(silu_mul(a, at::randn({3, 5})), c10::Error);
  // runtime.fused_kernels = false: ATen's two nodes, as before the gate was one.
  KernelChoices none;
  none.fused = 0;
  const at::Tensor plain = silu_mul(a, b, none);
  EXPECT_EQ(plain.grad_fn()->name().find("SiluMul"), std::string::npos) << plain.grad_fn()->name();
  EXPECT_TRUE(at::equal(plain, silu_mul(a, b)));
}
