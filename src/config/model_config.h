#pragma once
// From a run's configuration to the model's shapes and the dtype it computes in.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "config/config.h"
#include "kernels/kernel_choices.h"
#include "model/model_args.h"

namespace zb {

// The size table entry for (type_model, name_model), with [model] overrides, the vocabulary and
// the sequence length. Throws ConfigError for unknown names.
ModelArgs resolve_model_args(const Config& config);

// runtime.fused_kernels, runtime.unfused and runtime.varlen_kernel as the value the model, Muon,
// the gradient sums and the memory estimate are given (validate() checked the names).
KernelChoices resolve_kernel_choices(const Config& config);

// runtime.compute_dtype on `device`: "auto" is bf16 on CUDA, fp32 on CPU.
at::ScalarType resolve_compute_dtype(const Config& config, const c10::Device& device);

}  // namespace zb
