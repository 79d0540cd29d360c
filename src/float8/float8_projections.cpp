#include "float8/float8_projections.h"

#include <algorithm>

namespace zb {

bool Float8Projections::takes(int64_t layer, const std::string& name) const {
  const auto& names = names_.at(static_cast<size_t>(layer));
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::vector<at::Tensor> Float8Projections::linears(int64_t layer, const at::Tensor& x,
                                                   const std::vector<at::Tensor>& weights) const {
  TORCH_CHECK(x.numel() / x.size(-1) % 16 == 0, "float8: ", x.numel() / x.size(-1), " tokens in block ", layer,
              "'s GEMMs, not a multiple of 16 (FP8 GEMMs need it)");
  return float8_linears(x, weights, float8_.recipe, float8_.emulate, float8_.fsdp_all_gather);
}

std::vector<std::string> apply_float8(Llama& model, const Float8Linears& float8, int64_t tokens) {
  if (!float8.enabled) {
    model.set_projections(nullptr);
    return {};
  }
  const ModelArgs& args = model.args();
  const TpShare share = tp_share(args, model.tp_size());
  std::vector<std::vector<std::string>> names(args.n_layers);
  std::vector<std::string> cannot;
  for (const NamedParameter& p : model.parameters()) {
    const std::string leaf = float8_projection(p.name);
    if (leaf.empty()) continue;
    // This rank's GEMM: its slice under TP; shared key/value heads read kv_heads of them.
    int64_t out = p.slot->size(0);
    if (share.kv_shared && (leaf == "wk" || leaf == "wv")) out = share.kv_heads * args.head_dim();
    bool shape_refused = false;
    if (float8.takes(p.name, out, p.slot->size(1), tokens, &shape_refused))
      names[p.layer].push_back(leaf);
    else if (shape_refused)
      cannot.push_back(p.name.substr(0, p.name.rfind('.')) + " [" + std::to_string(out) + " x " +
                       std::to_string(p.slot->size(1)) + "]");
  }
  model.set_projections(std::make_shared<Float8Projections>(float8, std::move(names)));
  return cannot;
}

}  // namespace zb
