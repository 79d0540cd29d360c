#include "checkpoint/state.h"

#include <map>
#include <stdexcept>

namespace zb {

StateTensor state_tensor(const std::string& name, const at::Tensor& local, const ShardedParameter& p,
                         bool per_replica) {
  return {name, local, p.global_shape, p.row_start, p.replicated, per_replica, p.col_start, p.tp_shared};
}

std::vector<StateTensor> ModelState::tensors() {
  std::vector<StateTensor> out;
  std::map<std::string, ShardedParameter> by_name;
  for (const ShardedParameter& p : parallel_.parameters()) {
    out.push_back(state_tensor("model/" + p.name, *p.tensor, p, per_replica_));
    by_name.emplace(p.name, p);
  }
  for (const OptimizerState& s : optimizer_.state()) {
    const auto it = by_name.find(s.param);
    if (it == by_name.end()) throw std::logic_error("optimizer state of unknown parameter " + s.param);
    const std::string name = "optim/" + s.param + "." + s.key;
    if (s.tensor.dim() == 0) out.push_back({name, s.tensor, {}, 0, true});
    else
      out.push_back(state_tensor(name, s.tensor, it->second, per_replica_));
  }
  return out;
}

}  // namespace zb
