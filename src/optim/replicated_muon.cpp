#include "optim/replicated_muon.h"
#include "util/phase.h"

#include <ATen/ops/zeros.h>

namespace zb {

std::vector<at::Tensor> orthogonalize_once(const Muon& muon, const std::vector<at::Tensor>& inputs,
                                           const std::vector<const Muon::Param*>& params,
                                           const std::vector<int64_t>& owner, Communicator& comm) {
  std::vector<size_t> mine;
  std::vector<at::Tensor> mine_inputs;
  std::vector<const Muon::Param*> mine_params;
  int64_t total = 0;
  std::vector<int64_t> offsets;
  for (size_t i = 0; i < inputs.size(); ++i) {
    offsets.push_back(total);
    total += inputs[i].numel();
    if (owner[i] == comm.rank()) mine.push_back(i), mine_inputs.push_back(inputs[i]), mine_params.push_back(params[i]);
  }
  std::vector<at::Tensor> out;
  if (inputs.empty()) return out;
  const auto dtype = muon.hyper().ns_dtype;
  at::Tensor flat = at::zeros({total}, inputs.front().options().dtype(dtype));
  const std::vector<at::Tensor> results = muon.orthogonalize_held(mine_inputs, mine_params);
  for (size_t k = 0; k < mine.size(); ++k)
    flat.narrow(0, offsets[mine[k]], inputs[mine[k]].numel()).copy_(results[k].reshape({-1}));
  Phase phase("zb.muon.all_reduce");
  comm.all_reduce_sum(flat).wait();  // each entry is non-zero on exactly one rank
  for (size_t i = 0; i < inputs.size(); ++i)
    out.push_back(flat.narrow(0, offsets[i], inputs[i].numel()).view(inputs[i].sizes()));
  return out;
}

void make_muon_replicated(Muon& muon, Communicator& comm) {
  const std::vector<int64_t> owner = assign_muon_owners(muon, comm.size());
  muon.set_orthogonalizer([&muon, &comm, owner](const std::vector<at::Tensor>& inputs,
                                                const std::vector<const Muon::Param*>& active) {
    TORCH_CHECK(active.size() == muon.params().size(),
                "replicated Muon needs a gradient for every matrix on every rank");
    return orthogonalize_once(muon, inputs, active, owner, comm);
  });
}

}  // namespace zb
