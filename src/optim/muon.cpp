#include "optim/muon.h"

#include "kernels/fp32_updates.h"
#include "kernels/gemm_add.h"
#include "util/phase.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <stdexcept>

namespace zb {

const NsCoefficients& ns_coefficients(const std::string& name) {
  static const NsCoefficients jordan{"jordan", {{3.4445, -4.7750, 2.0315}}, 1.0, {2}};
  // The 5-step minimax table for singular values in [1e-3, 1] with a 2e-2 safety margin (the
  // Polar Express paper's algorithm; its reference code's values).
  static const NsCoefficients polar_express{"polar_express",
                                            {{8.156554524902461, -22.48329292557795, 15.878769915207462},
                                             {4.042929935166739, -2.808917465908714, 0.5000178451051316},
                                             {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
                                             {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
                                             {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}},
                                            1.02,
                                            {1, 3}};
  if (name == "jordan") return jordan;
  if (name == "polar_express") return polar_express;
  throw std::invalid_argument("unknown Newton-Schulz coefficients '" + name + "' (jordan, polar_express)");
}

at::Tensor newton_schulz(const at::Tensor& G, int64_t steps, at::ScalarType dtype, double eps,
                         bool through_cublaslt, const NsCoefficients& coefficients) {
  TORCH_CHECK(G.dim() == 2 || G.dim() == 3, "newton_schulz: expected [m, n] or [k, m, n], got ",
              G.sizes());
  const bool batched = G.dim() == 3;
  at::Tensor X = batched ? G.to(dtype) : G.to(dtype).unsqueeze(0);
  // Frobenius normalisation puts every singular value in [0, 1] (in [0, 1/safety]); eps keeps a
  // zero matrix zero.
  at::Tensor norm = at::linalg_vector_norm(X, 2, {-2, -1}, /*keepdim=*/true);
  if (coefficients.safety != 1.0) norm = norm * coefficients.safety;
  X = X / norm.clamp_min(eps);
  // Iterate on the short side, whose Gram matrix is the smaller. A wide X: A = X X^T and
  // X <- a X + B X. A tall one: the same iteration on X^T, written without transposing X (a
  // transposed X made each step's sum copy it, and its update reach the parameter strided:
  // 7 ms of the 1B step on an H100): A = X^T X and X <- a X + X B^T.
  const bool tall = X.size(1) > X.size(2);
  // The added terms read by the GEMMs themselves on a GPU (kernels/gemm_add.h), not copied first.
  const bool lt = through_cublaslt;
  for (int64_t i = 0; i < steps; ++i) {
    const auto& [a, b, c] = coefficients.step(i);
    at::Tensor A = tall ? at::bmm(X.mT(), X) : at::bmm(X, X.mT());
    at::Tensor B = gemm_add(A, A, A, /*beta=*/b, /*alpha=*/c, lt);  // b*A + c*A*A
    X = tall ? gemm_add(X, X, B.mT(), /*beta=*/a, 1.0, lt)           // a*X + X*B^T
             : gemm_add(X, B, X, /*beta=*/a, 1.0, lt);               // a*X + B*X
  }
  return batched ? X : X.squeeze(0);
}

namespace {
// Whether gram_newton_schulz rebuilds its iterate before step i (never before the first).
bool restarts_before(const std::vector<int64_t>& restarts, int64_t i) {
  return i > 0 && std::find(restarts.begin(), restarts.end(), i) != restarts.end();
}
}  // namespace

at::Tensor gram_newton_schulz(const at::Tensor& G, int64_t steps, at::ScalarType dtype, double eps,
                              bool through_cublaslt, const NsCoefficients& coefficients,
                              const std::optional<std::vector<int64_t>>& restarts_given) {
  const std::vector<int64_t>& restarts = restarts_given ? *restarts_given : coefficients.gram_restarts;
  TORCH_CHECK(G.dim() == 2 || G.dim() == 3, "gram_newton_schulz: expected [m, n] or [k, m, n], got ", G.sizes());
  TORCH_CHECK(steps > 0, "gram_newton_schulz: steps must be positive, got ", steps);
  const bool batched = G.dim() == 3;
  // The norm in fp32 at least (fp16's sum of squares overflows), then the iterate in `dtype`.
  at::Tensor X = (batched ? G : G.unsqueeze(0)).to(dtype == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor norm = at::linalg_vector_norm(X, 2, {-2, -1}, /*keepdim=*/true);
  if (coefficients.safety != 1.0) norm = norm * coefficients.safety;
  X = (X / norm.clamp_min(eps)).to(dtype);
  // A tall X is iterated as its transpose, copied wide once (X is read only at the start, the
  // restarts and the end; with transposed operands those products took about a sixth longer on
  // the CPU), and the result written tall: (Q Xᵀ)ᵀ = X Qᵀ.
  const bool tall = X.size(1) > X.size(2);
  if (tall) X = X.mT().contiguous();
  const bool lt = through_cublaslt;
  at::Tensor R = at::bmm(X, X.mT()), Q;
  for (int64_t i = 0; i < steps; ++i) {
    const auto& [a, b, c] = coefficients.step(i);
    if (restarts_before(restarts, i)) {
      X = at::bmm(Q, X);
      R = at::bmm(X, X.mT());
      Q = at::Tensor();
    }
    const at::Tensor Z = gemm_add(R, R, R, /*beta=*/b, /*alpha=*/c, lt);  // b R + c R²: P = a I + Z
    if (Q.defined()) {
      Q = gemm_add(Q, Q, Z, /*beta=*/a, 1.0, lt);  // Q P
    } else {
      Q = Z.clone();
      Q.diagonal(0, -2, -1).add_(a);
    }
    if (i + 1 < steps && !restarts_before(restarts, i + 1)) {  // the next step's R = P R P
      const at::Tensor RP = gemm_add(R, R, Z, /*beta=*/a, 1.0, lt);
      R = gemm_add(RP, Z, RP, /*beta=*/a, 1.0, lt);
    }
  }
  X = tall ? at::bmm(X.mT(), Q.mT()) : at::bmm(Q, X);
  return batched ? X : X.squeeze(0);
}

at::ScalarType gram_newton_schulz_dtype(at::ScalarType ns_dtype) {
  return ns_dtype == at::kFloat || ns_dtype == at::kDouble ? ns_dtype : at::kHalf;
}

double newton_schulz_multiply_adds(int64_t rows, int64_t cols, int64_t steps) {
  const double m = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(steps) * (2 * m * m * n + m * m * m);  // A = X Xᵀ, A², B X
}

double gram_newton_schulz_multiply_adds(int64_t rows, int64_t cols, int64_t steps, const std::vector<int64_t>& restarts) {
  const double m = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  double count = 2 * m * m * n;  // the first R and the last Q X
  bool fresh = true;             // Q not yet started (or restarted): Q = P costs nothing
  for (int64_t i = 0; i < steps; ++i) {
    if (restarts_before(restarts, i)) count += 2 * m * m * n, fresh = true;  // X = Q X, R = X Xᵀ
    count += m * m * m;                                                     // Z
    if (!fresh) count += m * m * m;                                         // Q P
    fresh = false;
    if (i + 1 < steps && !restarts_before(restarts, i + 1)) count += 2 * m * m * m;  // P R P
  }
  return count;
}

bool gram_newton_schulz_pays(int64_t rows, int64_t cols, int64_t steps, const NsCoefficients& coefficients) {
  return gram_newton_schulz_multiply_adds(rows, cols, steps, coefficients.gram_restarts) < newton_schulz_multiply_adds(rows, cols, steps);
}

double muon_update_scale(const std::string& mode, int64_t rows, int64_t cols) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  if (mode == "original") return std::sqrt(std::max(1.0, r / c));
  if (mode == "match_rms_adamw") return 0.2 * std::sqrt(std::max(r, c));
  throw std::invalid_argument("unknown Muon update scale '" + mode + "'");
}

Muon::Muon(const MuonHyper& hyper) : hyper_(hyper) {
  muon_update_scale(hyper.update_scale, 1, 1);  // reject an unknown mode now
  ns_coefficients(hyper.ns_coefficients);
  if (hyper.ns_algorithm != "standard" && hyper.ns_algorithm != "gram")
    throw std::invalid_argument("unknown Newton-Schulz algorithm '" + hyper.ns_algorithm + "' (standard, gram)");
}

void Muon::add_param(const std::string& name, const at::Tensor& param, std::vector<int64_t> global_shape,
                     std::vector<int64_t> slice_shape, int64_t tp_dim) {
  TORCH_CHECK(param.dim() == 2 || param.dim() == 3, "Muon takes 2-D matrices or a stack of them (a mixture of "
              "experts' [E, rows, cols]); ", name, " has shape ", param.sizes());
  if (global_shape.empty()) global_shape = param.sizes().vec();
  if (slice_shape.empty()) slice_shape = global_shape;
  params_.push_back({name, param, at::zeros_like(param, at::MemoryFormat::Contiguous),
                     std::move(global_shape), std::move(slice_shape), tp_dim});
}

std::vector<at::Tensor> Muon::orthogonalize_held(const std::vector<at::Tensor>& inputs,
                                                 const std::vector<const Param*>& params) const {
  return tensor_parallel_ ? tensor_parallel_(inputs, params) : orthogonalize_local(inputs);
}

std::vector<at::Tensor> Muon::orthogonalize_local(const std::vector<at::Tensor>& inputs) const {
  // Same-shape matrices go through Newton-Schulz together, as one batched computation; an expert
  // stack is a batch of its own (all the stacks of a model at once would hold several times the
  // experts' size in temporaries).
  std::map<std::pair<std::vector<int64_t>, size_t>, std::vector<size_t>> by_shape;
  for (size_t i = 0; i < inputs.size(); ++i) by_shape[{inputs[i].sizes().vec(), inputs[i].dim() == 3 ? i + 1 : 0}].push_back(i);
  std::vector<at::Tensor> out(inputs.size());
  for (const auto& [key, idx] : by_shape) {
    const std::vector<int64_t>& shape = key.first;
    const int64_t rows = shape[shape.size() - 2], cols = shape.back();
    const NsCoefficients& coefficients = ns_coefficients(hyper_.ns_coefficients);
    const bool gram =
        hyper_.ns_algorithm == "gram" && gram_newton_schulz_pays(rows, cols, hyper_.ns_steps, coefficients);
    Phase phase(gram ? "zb.muon.gram_newton_schulz" : "zb.muon.newton_schulz");
    // Stacked straight into Newton-Schulz's dtype, each matrix cast as it is copied (the values of
    // stacking in fp32 and casting the stack, one pass instead of two: ATen's stack and cast took
    // 4.3 ms of a 1B step on an H100).
    std::vector<int64_t> stacked_shape{static_cast<int64_t>(idx.size())};
    stacked_shape.insert(stacked_shape.end(), shape.begin(), shape.end());
    at::Tensor G = at::empty(stacked_shape, inputs[idx.front()].options().dtype(hyper_.ns_dtype));
    for (size_t j = 0; j < idx.size(); ++j) G[static_cast<int64_t>(j)].copy_(inputs[idx[j]]);
    // A stack of experts' matrices [E, rows, cols] is E matrices, each orthogonalised on its own:
    // all of them one batch, never the stack flattened into one matrix.
    const int64_t per_input = shape.size() == 3 ? shape[0] : 1;
    if (per_input == 0) {  // a rank that holds none of a stack's experts
      for (size_t j = 0; j < idx.size(); ++j) out[idx[j]] = inputs[idx[j]].to(hyper_.ns_dtype);
      continue;
    }
    const at::Tensor batch = G.view({-1, rows, cols});
    const bool lt = hyper_.kernels.on(Fused::NewtonSchulz);
    at::Tensor O = (gram ? gram_newton_schulz(batch, hyper_.ns_steps, gram_newton_schulz_dtype(hyper_.ns_dtype),
                                              hyper_.eps, lt, coefficients)
                               .to(hyper_.ns_dtype)
                         : newton_schulz(batch, hyper_.ns_steps, hyper_.ns_dtype, hyper_.eps, lt, coefficients))
                       .view(stacked_shape);
    for (size_t j = 0; j < idx.size(); ++j) out[idx[j]] = O[static_cast<int64_t>(j)];
    matrices_orthogonalized_ += static_cast<int64_t>(idx.size()) * per_input;
  }
  return out;
}

void Muon::step(double lr_multiplier) {
  at::NoGradGuard no_grad;
  std::vector<const Param*> active;
  std::vector<at::Tensor> params, grads, bufs;
  for (const auto& p : params_) {
    if (!p.param.grad().defined()) continue;
    active.push_back(&p);
    params.push_back(p.param);
    grads.push_back(p.param.grad());
    bufs.push_back(p.momentum_buffer);
  }
  if (active.empty()) return;
  const double mu = hyper_.momentum;
  // EMA momentum, on whatever rows this rank holds: buf = lerp(buf, g, 1 - mu); Nesterov's input
  // lerp(g, buf, mu).
  std::vector<at::Tensor> inputs = momentum_(bufs, grads, mu, hyper_.nesterov, hyper_.kernels);
  std::vector<at::Tensor> updates =
      orthogonalize_ ? orthogonalize_(inputs, active) : orthogonalize_held(inputs, active);

  const double lr = hyper_.lr * lr_multiplier;
  for (size_t i = 0; i < active.size(); ++i) {
    const auto& shape = active[i]->global_shape;  // an expert stack's scale is one expert's
    const double scale = muon_update_scale(hyper_.update_scale, shape[shape.size() - 2], shape.back());
    scale_add_(params[i], 1.0 - lr * hyper_.weight_decay, updates[i], -lr * scale,
               hyper_.kernels);  // decay, then the update
  }
}

std::vector<int64_t> assign_muon_owners(const Muon& muon, int64_t world_size) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : muon.params()) shapes.push_back(p.global_shape);
  return assign_owners_by_cost(shapes, world_size);
}

std::vector<int64_t> assign_owners_by_cost(const std::vector<std::vector<int64_t>>& shapes, int64_t world_size) {
  std::vector<double> cost(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    const std::vector<int64_t>& s = shapes[i];  // [rows, cols] or a stack [E, rows, cols]
    const double r = static_cast<double>(s[s.size() - 2]), c = static_cast<double>(s.back());
    cost[i] = (s.size() == 3 ? static_cast<double>(s[0]) : 1.0) * r * c * std::min(r, c);
  }
  std::vector<size_t> order(shapes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<double> load(static_cast<size_t>(world_size), 0.0);
  std::vector<int64_t> owner(shapes.size());
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[i] = least;
    load[least] += cost[i];
  }
  return owner;
}

}  // namespace zb
