#pragma once
// Muon: momentum, then Newton-Schulz orthogonalisation of the update, for 2-D hidden matrices
// (and a mixture of experts' stacks [E, rows, cols]: each expert's matrix on its own, scaled by
// its shape).
// Per parameter, as torch.optim.Muon (and ZeroBand) compute it:
//   buf    = momentum*buf + (1-momentum)*grad            (EMA; buf is fp32, shaped like the param)
//   u      = nesterov ? (1-momentum)*grad + momentum*buf : buf
//   O      = NewtonSchulz5(u)                           (bf16 by default; whole matrix)
//   param *= 1 - lr*wd                                   (decoupled decay, unadjusted lr)
//   param -= lr * scale(rows, cols) * O                  (scale from the *global* shape)
// The orthogonalisation is a replaceable function so that a sharded engine can run it on whole
// matrices assembled from row shards while momentum and update stay on the shards; under tensor
// parallelism a second replaceable stage completes what the data-parallel one assembles (each
// rank's TP slice of a matrix) into the whole matrix's orthogonalisation.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels/kernel_choices.h"

namespace zb {

// The quintic Newton-Schulz steps X <- a X + (b A + c A²) X, A = X Xᵀ (optim.optim.ns_coefficients):
// each step's (a, b, c), and the margin the first normalisation leaves, X = G / (||G||_F · safety).
//   "jordan": Keller Jordan's (3.4445, -4.7750, 2.0315) at every step, no margin. Fast, not
//     convergent: 5 steps leave singular values between about 0.7 and 1.2 (ZeroBand's, the default).
//   "polar_express": Amsel, Persson, Musco and Gower's minimax-optimal step for each of 5 steps
//     (singular values from 1e-3 up; each but the last divided by its safety margin, 2e-2), which
//     end within about 0.86..1.14 of 1; the margin 1.02 keeps rounding from pushing a singular
//     value past 1. Steps past the table repeat its last.
// gram_restarts: the steps before which gram_newton_schulz rebuilds its iterate (below).
struct NsCoefficients {
  std::string name;
  std::vector<std::array<double, 3>> table;
  double safety = 1.0;
  std::vector<int64_t> gram_restarts;
  const std::array<double, 3>& step(int64_t i) const {
    return table[static_cast<size_t>(std::min<int64_t>(i, static_cast<int64_t>(table.size()) - 1))];
  }
};
// Throws std::invalid_argument for another name.
const NsCoefficients& ns_coefficients(const std::string& name);

// Orthogonalises G ([m, n], or a batch [k, m, n] of same-shape matrices) in `dtype`:
// X = G / max(||G||_F · safety, eps), transposed so the Gram matrix is on the short side, then
// `steps` times X = a*X + (b*A + c*A*A)*X with A = X*X^T, (a, b, c) each step's of `coefficients`.
// Returns a tensor of `dtype` shaped like G. `through_cublaslt`: each GEMM reads its added term in
// its epilogue where cuBLASLt can (kernels/gemm_add.h; Fused::NewtonSchulz), else ATen's addmm and
// baddbmm.
at::Tensor newton_schulz(const at::Tensor& G, int64_t steps, at::ScalarType dtype, double eps = 1e-7,
                         bool through_cublaslt = true, const NsCoefficients& coefficients = ns_coefficients("jordan"));

// Gram Newton-Schulz (optim.optim.ns_algorithm = "gram"; Dao AI Lab, 2026): newton_schulz's steps
// computed on the short side's Gram matrix. A step X <- P X with P = a I + b R + c R², R = X Xᵀ,
// multiplies X by a polynomial of R, so after k steps X = Q X₀ with Q = P_k ⋯ P_1, and the next
// Gram matrix is P R P (P, R and Q commute: all are polynomials of the first R). The loop keeps R
// and Q (short × short) and reads X's long side only to start, at each restart and at the end:
// for 5 steps and one restart 4 m²n + 14 m³ multiply-adds against 10 m²n + 5 m³ (X m × n, m the
// short side). A restart rebuilds X = Q X and R from it, so that rounding gathered in Q does not
// compound. Its authors iterate in fp16, whose 10 mantissa bits hold Q where bf16's 7 do not
// (gram_newton_schulz_dtype), and restart before step 2: so do Jordan's coefficients here. Polar
// Express's first steps (a = 8.2, then 4.0) amplify fp16's rounding of R's small eigenvalues more:
// restarted before step 2 alone, the singular values of a 256 × 768 matrix spread over 3 decades
// came out up to 0.047 from exact; before steps 1 and 3, within 0.004 (GramNewtonSchulz.*).
// G: [m, n] or [k, m, n], normalised in fp32 (as newton_schulz, with the coefficients' margin),
// iterated in `dtype`; returns `dtype`, shaped like G. Equal to newton_schulz in exact arithmetic.
// `restarts`: the coefficients' gram_restarts unless given.
at::Tensor gram_newton_schulz(const at::Tensor& G, int64_t steps, at::ScalarType dtype, double eps = 1e-7,
                              bool through_cublaslt = true,
                              const NsCoefficients& coefficients = ns_coefficients("jordan"),
                              const std::optional<std::vector<int64_t>>& restarts = std::nullopt);
// fp16 where Newton-Schulz runs in 16 bits (ns_dtype bf16), else ns_dtype itself.
at::ScalarType gram_newton_schulz_dtype(at::ScalarType ns_dtype);
// Multiply-adds of each for one [rows, cols] matrix. ns_algorithm "gram" takes Gram Newton-Schulz
// only where it counts fewer (at 5 steps, with either restart schedule, a long side over 1.5 times
// the short one; never a square matrix): gram_newton_schulz_pays.
double newton_schulz_multiply_adds(int64_t rows, int64_t cols, int64_t steps);
double gram_newton_schulz_multiply_adds(int64_t rows, int64_t cols, int64_t steps, const std::vector<int64_t>& restarts);
bool gram_newton_schulz_pays(int64_t rows, int64_t cols, int64_t steps, const NsCoefficients& coefficients);

// lr multiplier from the global shape: "original" sqrt(max(1, rows/cols)) (Keller, ZeroBand) or
// "match_rms_adamw" 0.2*sqrt(max(rows, cols)) (Moonlight). Throws for another mode.
double muon_update_scale(const std::string& mode, int64_t rows, int64_t cols);

struct MuonHyper {
  double lr = 0.02;
  double weight_decay = 0.01;
  double momentum = 0.95;
  bool nesterov = true;
  int64_t ns_steps = 5;
  std::string ns_coefficients = "jordan";  // zb::ns_coefficients' names
  std::string ns_algorithm = "standard";   // or "gram": gram_newton_schulz where it pays
  std::string update_scale = "original";
  at::ScalarType ns_dtype = at::kBFloat16;  // kFloat for exact tests
  double eps = 1e-7;
  KernelChoices kernels;  // our momentum, update and Newton-Schulz GEMMs where they apply
};

class Muon {
 public:
  struct Param {
    std::string name;
    at::Tensor param;                   // updated in place (a local shard when sharded)
    at::Tensor momentum_buffer;         // fp32, shaped like `param`
    std::vector<int64_t> global_shape;  // [rows, cols] of the whole matrix, or [E, rows, cols] (the update scale)
    // Under tensor parallelism: the slice of it this rank's TP group position holds (what the
    // data-parallel shards divide) and the whole matrix's dimension split over TP (-1: none, every
    // TP rank holds it whole). Without TP: global_shape and -1.
    std::vector<int64_t> slice_shape;
    int64_t tp_dim = -1;
  };
  // inputs[i] is the update of params()[i] before orthogonalisation; returns the orthogonalised
  // updates, same shapes.
  using Orthogonalizer = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs,
                                                               const std::vector<const Param*>& params)>;

  explicit Muon(const MuonHyper& hyper);
  void add_param(const std::string& name, const at::Tensor& param, std::vector<int64_t> global_shape = {},
                 std::vector<int64_t> slice_shape = {}, int64_t tp_dim = -1);
  // One step at lr = hyper.lr * lr_multiplier. Parameters without a gradient are skipped.
  void step(double lr_multiplier);

  // Replaces the default stage (orthogonalize_held on the parameters as they are).
  void set_orthogonalizer(Orthogonalizer fn) { orthogonalize_ = std::move(fn); }
  // Under tensor parallelism: the stage that turns TP slices (inputs[i] is params[i]'s slice,
  // shaped slice_shape) into their slices of the whole matrices' orthogonalisation, collective
  // over the TP group (optim/tensor_parallel_muon.h).
  void set_tensor_parallel_stage(Orthogonalizer fn) { tensor_parallel_ = std::move(fn); }
  // Orthogonalises matrices as this rank holds them once assembled from data-parallel shards:
  // through the tensor-parallel stage if there is one, else whole, on this process. Replacements
  // of the default stage call it on what they assemble.
  std::vector<at::Tensor> orthogonalize_held(const std::vector<at::Tensor>& inputs,
                                             const std::vector<const Param*>& params) const;
  // Batched Newton-Schulz of whole matrices on this process (same-shape matrices together).
  std::vector<at::Tensor> orthogonalize_local(const std::vector<at::Tensor>& inputs) const;

  const MuonHyper& hyper() const { return hyper_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  // How many matrices went through Newton-Schulz so far (to test it ran, and once per matrix).
  int64_t matrices_orthogonalized() const { return matrices_orthogonalized_; }

 private:
  MuonHyper hyper_;
  std::vector<Param> params_;
  Orthogonalizer orthogonalize_;
  Orthogonalizer tensor_parallel_;
  mutable int64_t matrices_orthogonalized_ = 0;
};

// Owner rank of each of muon's matrices when they are orthogonalised once each across
// `world_size` ranks (sharded and replicated Muon alike): the Newton-Schulz cost
// (rows * cols * min(rows, cols), global shapes) balanced greedily, largest first; the same on
// every rank.
std::vector<int64_t> assign_muon_owners(const Muon& muon, int64_t world_size);
// The same for any list of matrix shapes ([rows, cols] each, or stacks [E, rows, cols]).
std::vector<int64_t> assign_owners_by_cost(const std::vector<std::vector<int64_t>>& shapes, int64_t world_size);

}  // namespace zb
