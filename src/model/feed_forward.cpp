#include "model/feed_forward.h"

#include <ATen/TensorOperators.h>

#include "model/layers.h"
#include "model_parallel/tensor_parallel.h"

namespace zb {

at::Tensor DenseSwiGLU::forward(const BlockContext& block, const at::Tensor& h, const at::Tensor& x) const {
  const TransformerBlockParams& b = block.params;
  const auto dt = block.compute_dtype;
  const at::Tensor y = block.tp ? gather_sequence(x, *block.tp) : x;
  const std::vector<at::Tensor> gate_up = block.project({"w1", "w3"}, y, {b.w1.to(dt), b.w3.to(dt)});
  const at::Tensor hidden = silu_mul(gate_up[0], gate_up[1], block.kernels);
  // Without TP the output linear and the residual add are one operation (residual_linear); under
  // TP the reduce-scatter comes between them.
  if (!block.tp && !block.projected_outside("w2")) return residual_linear(h, hidden, b.w2.to(dt), block.kernels);
  const at::Tensor out = block.project({"w2"}, hidden, {b.w2.to(dt)})[0];
  return h + (block.tp ? reduce_scatter_sequence(out, *block.tp) : out);
}

}  // namespace zb
