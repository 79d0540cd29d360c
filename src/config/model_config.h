#pragma once
// From a run's configuration to the model's shapes and the dtype it computes in.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "config/config.h"
#include "kernels/kernel_choices.h"
#include "float8/float8.h"
#include "model/model_args.h"

namespace zb {

// The size table entry for (type_model, name_model), with [model] overrides, the vocabulary and
// the sequence length. Throws ConfigError for unknown names.
ModelArgs resolve_model_args(const Config& config);

// runtime.fused_kernels, runtime.unfused and runtime.varlen_kernel as the value the model, Muon,
// the gradient sums and the memory estimate are given (validate() checked the names).
KernelChoices resolve_kernel_choices(const Config& config);

// [float8] as the model takes it (apply_float8, float8/float8_projections.h), and the step plan and memory estimate count it.
Float8Linears resolve_float8(const Config& config);
// The tokens in one of a rank's GEMMs: a micro-batch's rows, its share of them under CP.
int64_t gemm_tokens(const Config& config);

// runtime.compute_dtype on `device`: "auto" is bf16 on CUDA, fp32 on CPU.
at::ScalarType resolve_compute_dtype(const Config& config, const c10::Device& device);

}  // namespace zb
