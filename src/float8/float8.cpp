#include "float8/float8.h"
#include "kernels/cuda_ops.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/_unsafe_view.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/frexp.h>
#include <ATen/ops/ldexp.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/mm.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <tuple>

namespace zb {

Float8Recipe float8_recipe(const std::string& name) {
  if (name == "tensorwise") return Float8Recipe::Tensorwise;
  if (name == "rowwise") return Float8Recipe::Rowwise;
  if (name == "rowwise_with_gw_hp") return Float8Recipe::RowwiseWithGwHp;
  throw std::invalid_argument("unknown float8 recipe '" + name + "' (tensorwise | rowwise | rowwise_with_gw_hp)");
}

std::string float8_recipe_name(Float8Recipe recipe) {
  switch (recipe) {
    case Float8Recipe::Tensorwise: return "tensorwise";
    case Float8Recipe::Rowwise: return "rowwise";
    case Float8Recipe::RowwiseWithGwHp: return "rowwise_with_gw_hp";
  }
  return "?";
}

double float8_max(at::ScalarType fp8) {
  // e4m3fn: 1.75 * 2^8 (no infinities; the all-ones pattern is NaN); e5m2: 1.75 * 2^15.
  if (fp8 == at::kFloat8_e4m3fn) return 448.0;
  if (fp8 == at::kFloat8_e5m2) return 57344.0;
  throw std::invalid_argument("float8_max: not an FP8 type");
}

at::Tensor Float8Tensor::dequantised() const { return data.to(at::kFloat) * inverse_scale; }

namespace {
// The largest power of two at or below each (positive, finite) value: from the exponent alone
// (frexp's s = m 2^e with m in [0.5, 1): 2^(e-1)), since log2 rounds up to the next integer just
// below a power of two.
at::Tensor power_of_two_below(const at::Tensor& s) { return at::ldexp(at::ones_like(s), std::get<1>(at::frexp(s)) - 1); }
}  // namespace

at::Tensor float8_scale(const at::Tensor& amax, at::ScalarType fp8, bool power_of_two) {
  const at::Tensor scale = float8_max(fp8) / at::clamp(amax.to(at::kFloat), 1e-12);
  // A power of two makes x * scale exact: the only rounding is the FP8 cast's.
  return power_of_two ? power_of_two_below(scale) : scale;
}

at::Tensor to_float8_with_scale(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8) {
  const double max = float8_max(fp8);
  return x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).mul_(scale).clamp_(-max, max).to(fp8);
}

Float8Tensor to_float8(const at::Tensor& x, at::ScalarType fp8, bool rowwise, bool power_of_two, bool our_kernel) {
  TORCH_CHECK(x.dim() == 2, "to_float8: a matrix, got ", x.sizes());
  if (our_kernel && float8_cast_cuda_applies(x)) {  // the same values in one pass (kernels/cuda_ops.h)
    auto [data, inverse_scale] = float8_cast_cuda(x, fp8, rowwise, power_of_two);
    return {data, inverse_scale};
  }
  // The infinity norm reads |x| without writing it; the cast takes one fp32 copy of x.
  const at::Tensor amax = rowwise ? at::linalg_vector_norm(x, INFINITY, {1}, /*keepdim=*/true)
                                  : at::linalg_vector_norm(x, INFINITY);
  const at::Tensor scale = float8_scale(amax, fp8, power_of_two);
  return {to_float8_with_scale(x, scale, fp8), scale.reciprocal()};
}

at::Tensor float8_mm(const Float8Tensor& a, const Float8Tensor& b, at::ScalarType out_dtype, bool emulate,
                     bool fast_accumulation) {
  TORCH_CHECK(a.data.size(1) == b.data.size(1), "float8_mm: inner dimensions ", a.data.sizes(), " and ",
              b.data.sizes());
  if (emulate || !a.data.is_cuda())
    return at::mm(a.dequantised(), b.dequantised().t()).to(out_dtype);
  // cuBLASLt takes a row-major and b column-major: b [N, K] contiguous, transposed, is that. Row
  // scales go as [M, 1] and [1, N].
  const at::Tensor sb = b.inverse_scale.dim() == 0 ? b.inverse_scale : b.inverse_scale.t().contiguous();
  return at::_scaled_mm(a.data.contiguous(), b.data.contiguous().t(), a.inverse_scale, sb, std::nullopt,
                        std::nullopt, out_dtype, fast_accumulation);
}

namespace {

Float8Tensor transposed(const Float8Tensor& t) {  // the same values as the transposed matrix
  TORCH_CHECK(t.inverse_scale.dim() == 0, "only a tensorwise cast transposes as it is");
  return {t.data.t().contiguous(), t.inverse_scale};
}

// y_i = x w_i^T for weights sharing one input (q, k, v; the gate and up products), with x cast to
// FP8 once for all of them. The backward's GEMMs, dx = sum_i g_i w_i and dw_i = g_i^T x, cast g
// (and x, w again) as the recipe says: x and the weights are kept as they came, since a rowwise
// cast depends on the axis its GEMM sums over.
struct Float8LinearsNode : torch::autograd::Function<Float8LinearsNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                at::TensorList weights, int64_t recipe, bool emulate,
                                                bool weight_power_of_two) {
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    const bool rows = static_cast<Float8Recipe>(recipe) != Float8Recipe::Tensorwise;
    const Float8Tensor x8 = to_float8(x2, at::kFloat8_e4m3fn, rows, rows);
    torch::autograd::variable_list out, saved{x};
    for (const at::Tensor& w : weights) {
      // The forward's GEMMs accumulate in cuBLASLt's fast mode, as torchao's default.
      const at::Tensor y = float8_mm(x8, to_float8(w, at::kFloat8_e4m3fn, rows, rows || weight_power_of_two),
                                     x.scalar_type(), emulate,
                                     /*fast_accumulation=*/true);
      auto shape = x.sizes().vec();
      shape.back() = w.size(0);
      out.push_back(at::_unsafe_view(y, shape));  // a new tensor to autograd, not a view of one made here
      saved.push_back(w);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["recipe"] = recipe;
    ctx->saved_data["emulate"] = emulate;
    ctx->saved_data["weight_power_of_two"] = weight_power_of_two;
    ctx->set_materialize_grads(false);  // an output nothing used: no GEMMs for it
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "float8_linears has no second derivative (backward with create_graph)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const auto recipe = static_cast<Float8Recipe>(ctx->saved_data["recipe"].toInt());
    const bool emulate = ctx->saved_data["emulate"].toBool();
    const bool weight_power_of_two = ctx->saved_data["weight_power_of_two"].toBool();
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    const auto dt = x.scalar_type();
    auto e4m3_rows = [](const at::Tensor& t) { return to_float8(t, at::kFloat8_e4m3fn, true, true); };
    Float8Tensor xt;  // x transposed for the weight gradients, cast once (on first use)
    at::Tensor dx;
    torch::autograd::variable_list result{at::Tensor()};
    for (size_t i = 0; i < grads.size(); ++i) {
      const at::Tensor& w = saved[i + 1];
      if (!grads[i].defined()) {
        result.emplace_back();
        continue;
      }
      const at::Tensor g = grads[i].reshape({-1, w.size(0)});
      at::Tensor dxi, dwi;
      if (recipe == Float8Recipe::Tensorwise) {
        // One cast of each tensor serves both GEMMs; the gradient in e5m2 for its range.
        const Float8Tensor g8 = to_float8(g, at::kFloat8_e5m2, false, false);
        if (ctx->needs_input_grad(0))
          dxi = float8_mm(g8, transposed(to_float8(w, at::kFloat8_e4m3fn, false, weight_power_of_two)), dt, emulate);
        if (ctx->needs_input_grad(i + 1)) {
          if (!xt.data.defined()) xt = transposed(to_float8(x2, at::kFloat8_e4m3fn, false, false));
          dwi = float8_mm(transposed(g8), xt, w.scalar_type(), emulate);
        }
      } else {
        // Each operand scaled along the dimension its GEMM sums over: g's rows for dx, its columns
        // (the tokens) for dw.
        if (ctx->needs_input_grad(0)) dxi = float8_mm(e4m3_rows(g), e4m3_rows(w.t()), dt, emulate);
        if (ctx->needs_input_grad(i + 1)) {
          if (recipe == Float8Recipe::RowwiseWithGwHp) {
            dwi = at::mm(g.t(), x2);
          } else {
            if (!xt.data.defined()) xt = e4m3_rows(x2.t());
            dwi = float8_mm(e4m3_rows(g.t()), xt, w.scalar_type(), emulate);
          }
        }
      }
      if (dxi.defined()) dx = dx.defined() ? dx.add_(dxi) : dxi;
      result.push_back(dwi);
    }
    if (dx.defined()) result[0] = dx.view(x.sizes());
    result.emplace_back();  // recipe
    result.emplace_back();  // emulate
    result.emplace_back();  // weight_power_of_two
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> float8_linears(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                       Float8Recipe recipe, bool emulate, bool weight_power_of_two) {
  return Float8LinearsNode::apply(x, at::TensorList(weights), static_cast<int64_t>(recipe), emulate,
                                  weight_power_of_two);
}

at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& w, Float8Recipe recipe, bool emulate,
                         bool weight_power_of_two) {
  return float8_linears(x, {w}, recipe, emulate, weight_power_of_two)[0];
}

bool float8_takes(int64_t in_features, int64_t out_features, int64_t tokens) {
  return in_features % 16 == 0 && out_features % 16 == 0 && tokens % 16 == 0;
}

std::string float8_projection(const std::string& param_name) {
  const std::string suffix = ".weight";
  if (param_name.rfind("layers.", 0) != 0 || param_name.size() <= suffix.size() ||
      param_name.compare(param_name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return "";
  const std::string module = param_name.substr(0, param_name.size() - suffix.size());
  const std::string leaf = module.substr(module.rfind('.') + 1);
  static const char* kProjections[] = {"wq", "wk", "wv", "wo", "w1", "w2", "w3"};
  return std::find(std::begin(kProjections), std::end(kProjections), leaf) == std::end(kProjections) ? "" : leaf;
}

bool Float8Linears::takes(const std::string& param_name, int64_t out, int64_t in, int64_t tokens,
                          bool* shape_refused) const {
  if (shape_refused) *shape_refused = false;
  if (!enabled || float8_projection(param_name).empty()) return false;
  if (filtered(param_name.substr(0, param_name.rfind('.')))) return false;
  if (!float8_takes(in, out, tokens)) {
    if (shape_refused) *shape_refused = true;
    return false;
  }
  return true;
}

bool Float8Linears::filtered(const std::string& name) const {
  for (const std::string& f : filter_fqns)
    if (!f.empty() && name.find(f) != std::string::npos) return true;
  return false;
}

}  // namespace zb
