// Float8 linears (float8/float8.h), emulated, against float64: the FP8 grid written out here from
// its definition (round to nearest even with 3 or 2 mantissa bits, subnormals, saturation), the
// recipes' scales and GEMMs computed in double.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cfenv>
#include <cmath>

#include "config/model_config.h"
#include "float8/float8_projections.h"
#include "model/llama.h"

using namespace zb;

namespace {

struct Grid {
  int mantissa_bits, min_exponent;  // of the normal numbers; below it, subnormals at that exponent's spacing
  double max;
};
const Grid kE4M3{3, -6, 448.0}, kE5M2{2, -14, 57344.0};

// v rounded to the nearest FP8 value (ties to even), saturated at +-max.
double round_to_grid(double v, const Grid& g) {
  if (v == 0) return 0;
  int e2 = 0;
  std::frexp(std::fabs(v), &e2);  // |v| = f 2^e2, f in [0.5, 1): the exponent of |v| is e2 - 1
  const int e = std::max(e2 - 1, g.min_exponent);
  const double quantum = std::ldexp(1.0, e - g.mantissa_bits);
  const double r = std::nearbyint(std::fabs(v) / quantum) * quantum;  // the default mode: ties to even
  return std::copysign(std::min(r, g.max), v);
}

// The recipe's cast of x [rows, cols] in double: the scale in fp32 (max / amax, or a power of two
// below it), x * scale rounded to fp32, then to the grid; returns the dequantised values.
at::Tensor cast_reference(const at::Tensor& x, const Grid& g, bool rowwise, bool power_of_two) {
  at::Tensor x64 = x.to(at::kDouble).contiguous(), out = at::empty_like(x64);
  auto xa = x64.accessor<double, 2>();
  auto oa = out.accessor<double, 2>();
  const int64_t R = x64.size(0), C = x64.size(1);
  auto scale_of = [&](double amax) {
    double s = static_cast<float>(g.max / std::max(amax, 1e-12));
    if (power_of_two) s = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(s))));
    return s;
  };
  double whole = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) whole = std::max(whole, std::fabs(xa[r][c]));
  for (int64_t r = 0; r < R; ++r) {
    double amax = 0;
    for (int64_t c = 0; c < C; ++c) amax = std::max(amax, std::fabs(xa[r][c]));
    const double s = scale_of(rowwise ? amax : whole);
    for (int64_t c = 0; c < C; ++c) {
      const double scaled = std::clamp<double>(static_cast<float>(xa[r][c] * s), -g.max, g.max);
      oa[r][c] = round_to_grid(scaled, g) / s;
    }
  }
  return out;
}

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want).abs().max().item<double>() / want.abs().max().item<double>();
}

// Values over many magnitudes (and a row of zeros), so that subnormals and saturation both occur.
at::Tensor spread(int64_t rows, int64_t cols) {
  at::Tensor x = at::randn({rows, cols}) * at::exp2(at::randint(-12, 6, {rows, cols}).to(at::kFloat));
  x[0].zero_();
  return x;
}

}  // namespace

TEST(Float8, CastsOntoTheGridAsDefined) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  at::manual_seed(0);
  const at::Tensor x = spread(24, 40);
  for (const auto& [fp8, grid] : {std::pair{at::kFloat8_e4m3fn, kE4M3}, std::pair{at::kFloat8_e5m2, kE5M2}})
    for (bool rowwise : {false, true})
      for (bool power_of_two : {false, true}) {
        const Float8Tensor q = to_float8(x, fp8, rowwise, power_of_two);
        EXPECT_EQ(q.data.scalar_type(), fp8);
        EXPECT_EQ(q.inverse_scale.dim(), rowwise ? 2 : 0);
        // Both sides hold the same values: equal to the last bit, but for the division by the scale.
        const at::Tensor want = cast_reference(x, grid, rowwise, power_of_two);
        EXPECT_LE((q.dequantised().to(at::kDouble) - want).abs().max().item<double>(),
                  1e-6 * want.abs().max().item<double>())
            << c10::toString(fp8) << " rowwise " << rowwise << " power_of_two " << power_of_two;
        // Without the rounding of the scale the largest value lands on the top of the grid.
        if (!power_of_two) EXPECT_EQ(q.data.to(at::kFloat).abs().max().item<double>(), grid.max);
      }
}

TEST(Float8, LinearForwardAndBackwardFollowEachRecipe) {
  at::manual_seed(1);
  const int64_t M = 32, K = 48, N = 64;
  const at::Tensor x0 = at::randn({2, M / 2, K}), w0 = at::randn({N, K}) * 0.05, g0 = at::randn({2, M / 2, N});
  const at::Tensor x2 = x0.reshape({M, K}), g2 = g0.reshape({M, N});
  for (Float8Recipe recipe : {Float8Recipe::Tensorwise, Float8Recipe::Rowwise, Float8Recipe::RowwiseWithGwHp}) {
    const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const at::Tensor y = float8_linear(x, w, recipe, /*emulate=*/true);
    y.backward(g0);
    at::Tensor y_ref, dx_ref, dw_ref;
    if (recipe == Float8Recipe::Tensorwise) {
      // One scale per tensor; the gradient on e5m2's grid.
      const at::Tensor xq = cast_reference(x2, kE4M3, false, false), wq = cast_reference(w0, kE4M3, false, false);
      const at::Tensor gq = cast_reference(g2, kE5M2, false, false);
      y_ref = xq.mm(wq.t());
      dx_ref = gq.mm(wq);
      dw_ref = gq.t().mm(xq);
    } else {
      // Each operand scaled per row of the dimension its GEMM sums over, by powers of two.
      auto rows = [](const at::Tensor& t) { return cast_reference(t, kE4M3, true, true); };
      y_ref = rows(x2).mm(rows(w0).t());
      dx_ref = rows(g2).mm(rows(w0.t()).t());
      dw_ref = recipe == Float8Recipe::Rowwise ? rows(g2.t()).mm(rows(x2.t()).t())
                                               : g2.t().to(at::kDouble).mm(x2.to(at::kDouble));
    }
    const std::string name = float8_recipe_name(recipe);
    // fp32 GEMMs over exact FP8 values against double: accumulation order only.
    EXPECT_LT(relative_error(y.reshape({M, N}), y_ref), 1e-6) << name;
    EXPECT_LT(relative_error(x.grad().reshape({M, K}), dx_ref), 1e-6) << name;
    EXPECT_LT(relative_error(w.grad(), dw_ref), 1e-6) << name;
    // And FP8 is FP8: the products differ from the exact ones by about the grid's spacing.
    const at::Tensor exact = x2.to(at::kDouble).mm(w0.to(at::kDouble).t());
    EXPECT_GT(relative_error(y.reshape({M, N}), exact), 1e-4) << name;
    EXPECT_LT(relative_error(y.reshape({M, N}), exact), 0.1) << name;
  }
}

TEST(Float8, ModelRunsItsProjectionsInFp8WhereAsked) {
  ModelArgs a = lookup_model_args("llama2", "debugmodel");
  a.vocab_size = 1024;
  a.max_seq_len = 32;
  at::manual_seed(2);
  Llama model(a, at::TensorOptions());
  model.init_weights();
  const at::Tensor tokens = at::randint(0, a.vocab_size, {2, 32}), targets = at::randint(0, a.vocab_size, {2, 32});
  const double bf = model.loss(tokens, targets).item<double>();

  // Every projection in FP8: a different loss, but close (FP8's rounding, about 2^-4 a value).
  Float8Linears f8{true, Float8Recipe::Tensorwise, true, {"output"}};
  EXPECT_TRUE(apply_float8(model, f8, 64).empty());
  for (int64_t l = 0; l < a.n_layers; ++l)
    for (const char* p : {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}) EXPECT_TRUE(model.projected_outside(l, p)) << l << p;
  const double fp8 = model.loss(tokens, targets).item<double>();
  EXPECT_NE(fp8, bf);
  EXPECT_NEAR(fp8, bf, 0.02 * bf);

  // Filtered by name: block 0's w2 and all of block 1 stay out.
  f8.filter_fqns = {"layers.0.feed_forward.w2", "layers.1."};
  EXPECT_TRUE(apply_float8(model, f8, 64).empty());
  EXPECT_FALSE(model.projected_outside(0, "w2"));
  EXPECT_TRUE(model.projected_outside(0, "w1"));
  EXPECT_FALSE(model.projected_outside(1, "wq"));
  // Every block filtered out: the model as without FP8, to the bit.
  f8.filter_fqns = {"layers."};
  EXPECT_TRUE(apply_float8(model, f8, 64).empty());
  EXPECT_EQ(model.loss(tokens, targets).item<double>(), bf);

  // Tokens FP8 GEMMs cannot take: every projection stays out, each named.
  f8.filter_fqns = {};
  const std::vector<std::string> kept = apply_float8(model, f8, 40);
  ASSERT_EQ(kept.size(), static_cast<size_t>(7 * a.n_layers));
  EXPECT_EQ(kept[0], "layers.0.attention.wq [256 x 256]");
  EXPECT_FALSE(model.projected_outside(0, "wq"));
}

TEST(Float8, GatheredWeightsCastBackToTheirOwnBytes) {
  // FP8 all-gather: a weight's shards go as e4m3 bytes cast with a power-of-two scale of the whole
  // weight's amax, and arrive dequantised in the compute dtype (fsdp/fsdp_collectives.h); the FP8
  // GEMM's own tensorwise cast (power-of-two weight scales under the gather) must give back the
  // very bytes and scale that travelled, in fp32 and in bf16.
  at::manual_seed(3);
  const at::Tensor w = spread(48, 64);
  const at::Tensor scale = float8_scale(w.abs().amax(), at::kFloat8_e4m3fn, /*power_of_two=*/true);
  EXPECT_EQ(scale.item<float>(), std::ldexp(1.0f, static_cast<int>(std::floor(std::log2(448.0 / w.abs().amax().item<double>())))));
  const at::Tensor sent = to_float8_with_scale(w, scale, at::kFloat8_e4m3fn);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor arrived = (sent.to(at::kFloat) * scale.reciprocal()).to(dtype);
    EXPECT_TRUE(arrived.to(at::kFloat).mul(scale).equal(sent.to(at::kFloat))) << "dequantised exactly";
    const Float8Tensor again = to_float8(arrived, at::kFloat8_e4m3fn, /*rowwise=*/false, /*power_of_two=*/true);
    EXPECT_TRUE(again.data.view(at::kByte).equal(sent.view(at::kByte))) << c10::toString(dtype);
    EXPECT_EQ(again.inverse_scale.item<float>(), scale.reciprocal().item<float>()) << c10::toString(dtype);
  }
}
