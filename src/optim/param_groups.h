#pragma once
// Parameters grouped by role, as ZeroBand does: the 2-D matrices inside transformer blocks are
// the "hidden" group (Muon's); the token embedding, the output head and the norm weights each get
// an AdamW group of their own.
#include <string>
#include <vector>

#include "parallel/parallel_model.h"

namespace zb {

enum class ParamRole { Hidden, Embedding, Head, Norm };
const char* role_name(ParamRole role);
ParamRole param_role(const std::string& name, int64_t ndim);

struct ParamGroup {
  ParamRole role;
  std::vector<ShardedParameter> params;
};
// Groups in a fixed order (hidden, embedding, head, norm); empty groups are left out.
std::vector<ParamGroup> group_parameters(const std::vector<ShardedParameter>& params);

}  // namespace zb
