#pragma once
// Newton-Schulz on a matrix split over the ranks of a group, without gathering it (parallel.muon_tp
// = "split", optim/tensor_parallel_muon.h; not Gram Newton-Schulz, optim/muon.h, which iterates
// on one rank's whole matrix). Each rank holds a block of consecutive rows (shard_dim 0) or
// columns (shard_dim 1) of the [rows, cols] matrix G and gets its block of newton_schulz(G) back. Every iteration all-reduces one Gram matrix
// instead: with X the iterate on the short side (Gᵀ when G is tall),
//
//   blocks split X's long side (X = [X₁ X₂ …]):   A = Σ Xᵢ Xᵢᵀ   (short × short), Xᵢ ← a Xᵢ + (b A + c A²) Xᵢ
//   blocks split X's short side (X = [X₁; X₂; …]): B = Σ Xᵢᵀ Xᵢ   (long × long),   Xᵢ ← a Xᵢ + Xᵢ (b B + c B²)
//
// the second being the first rewritten through A X = X B. The Frobenius norm that starts the
// iteration is one more all-reduce of a scalar. Per iteration a rank sends and receives a Gram
// matrix (short² or long² values) where gathering would move the whole matrix once: the caller
// chooses by cost.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dist/comm.h"
#include "optim/muon.h"

namespace zb {

at::Tensor split_newton_schulz(const at::Tensor& local, int64_t shard_dim, int64_t rows, int64_t cols,
                               Communicator& group, int64_t steps, at::ScalarType dtype, double eps = 1e-7,
                               const NsCoefficients& coefficients = ns_coefficients("jordan"));

// Values of the Gram matrix each iteration all-reduces for a [rows, cols] matrix split along
// `shard_dim`: the square of the side the blocks do not split.
int64_t split_newton_schulz_gram_numel(int64_t shard_dim, int64_t rows, int64_t cols);

}  // namespace zb
