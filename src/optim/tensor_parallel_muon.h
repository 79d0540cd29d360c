#pragma once
// Muon under tensor parallelism (issue 30). A rank of a TP group holds a slice of each split
// matrix (rows of a column-parallel weight, columns of a row-parallel one); Newton-Schulz needs
// the whole matrix. Two ways to get it, chosen per matrix:
//
//   gather: the TP group's ranks own the matrices (balanced by Newton-Schulz cost); each rank
//     sends its slice to the owner, which orthogonalises the whole matrix once and sends every
//     rank its slice back (Moonlight's extra gather over TP). Column slices travel as rows of the
//     transpose: NS(Gᵀ) = NS(G)ᵀ.
//   split: Newton-Schulz on the slices themselves, all-reducing one Gram matrix per iteration
//     (optim/split_newton_schulz.h, Megatron's distributed mode): nobody assembles the matrix.
//
// Over the group, gather moves 2 (tp - 1) slices of the matrix and split 2 (tp - 1) Gram matrices
// per iteration (ring all-reduce), so "auto" splits only where steps x the Gram matrix is
// smaller than a slice: a matrix much longer than wide, split along its long side. For Llama's
// shapes that is never, and gather is what runs. Matrices every TP rank holds whole (shared
// key/value heads) are orthogonalised on each rank, as without TP.
#include <cstdint>
#include <string>

#include "dist/comm.h"
#include "optim/muon.h"

namespace zb {

// Installs the stage on `muon` (Muon::set_tensor_parallel_stage). mode: "auto", "gather" or "split"
// (parallel.muon_tp; not Gram Newton-Schulz, optim.optim.ns_algorithm, which is one rank's).
void make_muon_tensor_parallel(Muon& muon, Communicator& tp, const std::string& mode);

// Whether `mode` orthogonalises a [rows, cols] matrix split along tp_dim over tp ranks with the
// slices, a Gram matrix all-reduced per iteration (true), or by gathering it to an owner (false).
bool muon_tp_splits(const std::string& mode, int64_t tp_dim, int64_t rows, int64_t cols, int64_t tp,
                    int64_t ns_steps);

}  // namespace zb
