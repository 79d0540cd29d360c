#include "parallel/parallel_model.h"

namespace zb {

std::vector<ShardedParameter> whole_parameters(const std::vector<NamedParameter>& params) {
  std::vector<ShardedParameter> out;
  for (const auto& p : params) out.push_back({p.name, p.slot, p.slot->sizes().vec(), 0, false});
  return out;
}

}  // namespace zb
