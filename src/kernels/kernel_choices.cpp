#include "kernels/kernel_choices.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>

#ifdef ZB_WITH_CUDA
#include "kernels/cuda_ops.h"
#endif

namespace zb {

namespace {
const char* const kFusedNames[] = {"rope", "gate", "loss", "norm", "linears", "update", "momentum",
                                    "residual", "newton_schulz"};  // Fused's order
}  // namespace

std::vector<std::string> fused_operator_names() { return {std::begin(kFusedNames), std::end(kFusedNames)}; }

std::vector<std::string> split_operator_names(const std::string& list) {
  std::vector<std::string> out;
  std::string name;
  for (const char c : list + ",") {
    if (c == ',') {
      if (!name.empty()) out.push_back(name);
      name.clear();
    } else if (c != ' ') {
      name += c;
    }
  }
  return out;
}

bool fused_kernels_run_on(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  return device.is_cuda() && cuda_kernels_run_on(device);
#else
  (void)device;
  return false;
#endif
}

bool KernelChoices::node_takes(Fused op, const at::Tensor& x) const {
  return on(op) && (nodes_on_any_device || (x.scalar_type() == at::kBFloat16 && fused_kernels_run_on(x.device())));
}

KernelChoices KernelChoices::from(bool fused_kernels, const std::string& unfused, const std::string& varlen_kernel) {
  KernelChoices k;
  if (varlen_kernel != "flash" && varlen_kernel != "cudnn")
    throw std::invalid_argument("runtime.varlen_kernel: unknown kernel \"" + varlen_kernel + "\" (flash or cudnn)");
  k.cudnn_varlen = varlen_kernel == "cudnn";
  // The names are checked even when fused_kernels turns every operator off.
  for (const std::string& name : split_operator_names(unfused)) {
    const auto* it = std::find(std::begin(kFusedNames), std::end(kFusedNames), name);
    if (it == std::end(kFusedNames)) {
      std::string list;
      for (const char* known : kFusedNames) list += (list.empty() ? "" : ", ") + std::string(known);
      throw std::invalid_argument("runtime.unfused names '" + name + "', not one of " + list);
    }
    k.fused &= ~(1u << (it - std::begin(kFusedNames)));
  }
  if (!fused_kernels) k.fused = 0;
  return k;
}

}  // namespace zb
