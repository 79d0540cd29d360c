#include "optim/split_newton_schulz.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sqrt.h>

#include "optim/muon.h"

namespace zb {

int64_t split_newton_schulz_gram_numel(int64_t shard_dim, int64_t rows, int64_t cols) {
  const int64_t unsplit = shard_dim == 0 ? cols : rows;
  return unsplit * unsplit;
}

at::Tensor split_newton_schulz(const at::Tensor& local, int64_t shard_dim, int64_t rows, int64_t cols,
                               Communicator& group, int64_t steps, at::ScalarType dtype, double eps,
                               const NsCoefficients& coefficients) {
  TORCH_CHECK(local.dim() == 2 && (shard_dim == 0 || shard_dim == 1), "split_newton_schulz: a 2-D block split along 0 or 1");
  TORCH_CHECK(local.size(1 - shard_dim) == (shard_dim == 0 ? cols : rows),
              "split_newton_schulz: the block ", local.sizes(), " does not span the unsplit side of [", rows, ", ", cols, "]");
  // The iterate on the short side, as newton_schulz: a tall matrix is transposed, and so is the
  // side its blocks split.
  at::Tensor X = local.to(dtype);
  const bool tall = rows > cols;
  if (tall) X = X.t();
  const bool split_long_side = (tall ? 1 - shard_dim : shard_dim) == 1;

  at::Tensor norm_squared = X.square().sum().reshape({1});
  group.all_reduce_sum(norm_squared).wait();
  at::Tensor norm = at::sqrt(norm_squared);
  if (coefficients.safety != 1.0) norm = norm * coefficients.safety;
  X = X / norm.clamp_min(eps);
  for (int64_t i = 0; i < steps; ++i) {
    const auto& [a, b, c] = coefficients.step(i);
    at::Tensor gram = split_long_side ? at::mm(X, X.t()) : at::mm(X.t(), X);
    group.all_reduce_sum(gram).wait();
    const at::Tensor poly = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);  // b G + c G²
    X = split_long_side ? at::addmm(X, poly, X, /*beta=*/a) : at::addmm(X, X, poly, /*beta=*/a);
  }
  return tall ? X.t() : X;
}

}  // namespace zb
