#pragma once
// Which of our fused operators and kernels a run uses: one value, resolved once from the config
// (config/model_config.h's resolve_kernel_choices) and handed to what uses them: the model's
// layers and attention, the engines' gradient sums (through the model), Muon, the memory estimate.
// Nothing here is process-wide. The model's layer functions take it last with all fused as the
// default, for tests and tools; the model passes its own (Llama::kernels) to each, and the parts
// a run builds (engines, optimizer) take it without a default.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <string>
#include <vector>

namespace zb {

// Our fused operators, each by name (runtime.unfused): "rope", "gate" (SwiGLU's), "loss" (its
// log-sum-exp and logit gradient), "norm" (RMSNorm with the residual's gradient), "linears"
// (shared_input_linears), "update" (the fp32 gradient sums and Muon's update of the weights,
// kernels/fp32_updates.h), "momentum" (Muon's), "residual" (residual_linear's one GEMM),
// "newton_schulz" (Muon's GEMMs reading their added term in the epilogue, kernels/gemm_add.h).
enum class Fused { Rope, Gate, Loss, Norm, Linears, Update, Momentum, Residual, NewtonSchulz };
std::vector<std::string> fused_operator_names();  // in Fused's order
std::vector<std::string> split_operator_names(const std::string& list);  // "a, b" -> {"a", "b"}

// Whether our CUDA kernels run on `device`: a GPU this build has their image for (they take bf16).
bool fused_kernels_run_on(const c10::Device& device);

struct KernelChoices {
  static constexpr unsigned kAllFused = (1u << 9) - 1;
  // Bit i: Fused(i) on. All by default; none is the model as ATen's operators alone, as autograd
  // differentiates them (runtime.fused_kernels = false).
  unsigned fused = kAllFused;
  // Document attention's kernel on a GPU (runtime.varlen_kernel): LibTorch's variable-length flash
  // kernels ("flash", false), or cuDNN's forward with flash's backward ("cudnn", true).
  bool cudnn_varlen = false;
  // For tests on a machine without a GPU: the autograd nodes that on a GPU call our kernels
  // (rms_norm_residual, shared_input_linears) taken on any device and dtype, where they run their
  // formulas in ATen's operators; so a whole model trains through them.
  bool nodes_on_any_device = false;

  bool on(Fused op) const { return (fused >> static_cast<unsigned>(op)) & 1u; }
  // Whether the fused autograd node `op` takes x: where our kernels run (bf16 on a GPU this build
  // has their image for), or anywhere with nodes_on_any_device.
  bool node_takes(Fused op, const at::Tensor& x) const;
  // Whether our kernel for `op` may run on `device`'s tensors (whether it takes them is the
  // kernel's own check).
  bool kernel_takes(Fused op, const c10::Device& device) const { return on(op) && fused_kernels_run_on(device); }

  // From the config's words: runtime.fused_kernels, runtime.unfused (names, comma-separated: those
  // left to ATen) and runtime.varlen_kernel. An unknown name is std::invalid_argument.
  static KernelChoices from(bool fused_kernels, const std::string& unfused, const std::string& varlen_kernel);
};

}  // namespace zb
