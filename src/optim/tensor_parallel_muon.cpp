#include "optim/tensor_parallel_muon.h"

#include <stdexcept>

#include "optim/split_newton_schulz.h"
#include "optim/sharded_muon.h"
#include "util/phase.h"

namespace zb {

bool muon_tp_splits(const std::string& mode, int64_t tp_dim, int64_t rows, int64_t cols, int64_t tp,
                    int64_t ns_steps) {
  if (mode == "gather") return false;
  if (mode == "split") return true;
  if (mode != "auto") throw std::invalid_argument("unknown parallel.muon_tp '" + mode + "'");
  // Elements moved over the group (the factor 2 (tp - 1) common to both dropped).
  const int64_t slice = rows * cols / tp;
  return ns_steps * split_newton_schulz_gram_numel(tp_dim, rows, cols) < slice;
}

void make_muon_tensor_parallel(Muon& muon, Communicator& tp, const std::string& mode) {
  muon_tp_splits(mode, 0, 1, 1, 1, 1);  // reject an unknown mode now
  muon.set_tensor_parallel_stage([&muon, &tp, mode](const std::vector<at::Tensor>& inputs,
                                                    const std::vector<const Muon::Param*>& params) {
    const MuonHyper& h = muon.hyper();
    std::vector<at::Tensor> out(inputs.size());
    std::vector<size_t> whole, gathered;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Muon::Param& p = *params[i];
      const int64_t rows = p.global_shape[0], cols = p.global_shape[1];
      if (p.tp_dim < 0) {
        whole.push_back(i);
      } else if (muon_tp_splits(mode, p.tp_dim, rows, cols, tp.size(), h.ns_steps)) {
        Phase phase("zb.muon.split_newton_schulz");
        out[i] = split_newton_schulz(inputs[i], p.tp_dim, rows, cols, tp, h.ns_steps, h.ns_dtype, h.eps,
                                     ns_coefficients(h.ns_coefficients));
      } else {
        gathered.push_back(i);
      }
    }

    // Held whole by every TP rank (with the same values): each orthogonalises them itself.
    std::vector<at::Tensor> held;
    for (size_t i : whole) held.push_back(inputs[i]);
    const std::vector<at::Tensor> done = muon.orthogonalize_local(held);
    for (size_t k = 0; k < whole.size(); ++k) out[whole[k]] = done[k];

    // Gathered: a TP slice is a block of rows of the matrix (tp_dim 0) or of its transpose (1).
    std::vector<at::Tensor> rows;
    std::vector<std::vector<int64_t>> shapes, global;
    for (size_t i : gathered) {
      const Muon::Param& p = *params[i];
      const bool columns = p.tp_dim == 1;
      rows.push_back(columns ? inputs[i].mT() : inputs[i]);
      shapes.push_back(columns ? std::vector<int64_t>{p.global_shape[1], p.global_shape[0]} : p.global_shape);
      global.push_back(p.global_shape);
    }
    const std::vector<at::Tensor> results = orthogonalize_by_owner(
        rows, shapes, assign_owners_by_cost(global, tp.size()), tp, h.ns_dtype, "zb.muon.tp_all_to_all",
        [&muon](const std::vector<at::Tensor>& matrices, const std::vector<size_t>&) {
          return muon.orthogonalize_local(matrices);
        });
    for (size_t k = 0; k < gathered.size(); ++k)
      out[gathered[k]] = params[gathered[k]]->tp_dim == 1 ? results[k].mT() : results[k];
    return out;
  });
}

}  // namespace zb
