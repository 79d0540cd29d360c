#include "optim/param_groups.h"

namespace zb {

const char* role_name(ParamRole role) {
  switch (role) {
    case ParamRole::Hidden: return "hidden";
    case ParamRole::Embedding: return "embedding";
    case ParamRole::Head: return "head";
    case ParamRole::Norm: return "norm";
  }
  return "?";
}

ParamRole param_role(const std::string& name, int64_t ndim) {
  if (name.rfind("tok_embeddings.", 0) == 0) return ParamRole::Embedding;
  if (name.rfind("output.", 0) == 0) return ParamRole::Head;
  if (ndim < 2) return ParamRole::Norm;
  if (name.rfind("layers.", 0) == 0) return ParamRole::Hidden;
  // A 2-D parameter outside the blocks that is neither embedding nor head does not exist in this
  // model; treat it like the head (AdamW) rather than guess it is a hidden matrix.
  return ParamRole::Head;
}

std::vector<ParamGroup> group_parameters(const std::vector<ShardedParameter>& params) {
  std::vector<ParamGroup> groups;
  for (ParamRole role : {ParamRole::Hidden, ParamRole::Embedding, ParamRole::Head, ParamRole::Norm}) {
    ParamGroup g{role, {}};
    for (const auto& p : params)
      if (param_role(p.name, static_cast<int64_t>(p.global_shape.size())) == role) g.params.push_back(p);
    if (!g.params.empty()) groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace zb
