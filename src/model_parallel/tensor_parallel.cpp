#include "model_parallel/tensor_parallel.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

namespace zb {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The collectives move flat buffers in rank order; the sequence is dimension 1. Rank r's [B, t]
// block is contiguous in the buffer [size, B, t, ...]; the whole sequence is its transpose.
std::vector<int64_t> with_sequence(const at::Tensor& x, int64_t t) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[1] = t;
  return shape;
}

at::Tensor all_gather_sequence(const at::Tensor& x, ModelParallelGroup& group) {
  const int64_t n = group.size();
  std::vector<int64_t> blocks = x.sizes().vec();
  blocks.insert(blocks.begin(), n);  // [size, B, t, ...]
  at::Tensor buffer = at::empty(blocks, x.options());
  group.all_gather(buffer, x.contiguous());
  // A view when B == 1; else one copy into [B, size*t, ...].
  return buffer.transpose(0, 1).reshape(with_sequence(x, n * x.size(1)));
}

at::Tensor reduce_scatter_along_sequence(const at::Tensor& x, ModelParallelGroup& group) {
  const int64_t n = group.size(), T = x.size(1);
  TORCH_CHECK(T % n == 0, "tensor parallelism: the sequence (", T, " positions) must divide into ", n, " ranks");
  std::vector<int64_t> split = x.sizes().vec();
  split[1] = T / n;
  split.insert(split.begin() + 1, n);  // [B, size, t, ...]
  at::Tensor input = x.reshape(split).transpose(0, 1).contiguous();  // [size, B, t, ...]
  at::Tensor out = at::empty(with_sequence(x, T / n), x.options());
  group.reduce_scatter_sum(out, input);
  return out;
}

struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, ModelParallelGroup* group) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    return {all_gather_sequence(x, *group)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<ModelParallelGroup*>(ctx->saved_data["group"].toInt());
    return {reduce_scatter_along_sequence(grads[0], *group), at::Tensor()};
  }
};

struct ReduceScatterSequence : torch::autograd::Function<ReduceScatterSequence> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, ModelParallelGroup* group) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    return {reduce_scatter_along_sequence(x, *group)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<ModelParallelGroup*>(ctx->saved_data["group"].toInt());
    return {all_gather_sequence(grads[0], *group), at::Tensor()};
  }
};

struct ReplicatedWeight : torch::autograd::Function<ReplicatedWeight> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& w, ModelParallelGroup* group) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    return {w.view_as(w)};  // an alias: autograd needs an output of its own
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<ModelParallelGroup*>(ctx->saved_data["group"].toInt());
    // Summed in place, in fp32 at least, as every other gradient sum: in bf16 a ring would round at
    // each hop. Autograd casts it back to w's dtype once.
    const at::ScalarType sum_dtype = at::promote_types(grads[0].scalar_type(), at::kFloat);
    at::Tensor g = grads[0].to(sum_dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
    group->all_reduce_sum(g);
    return {g, at::Tensor()};
  }
};

}  // namespace

at::Tensor gather_sequence(const at::Tensor& x, ModelParallelGroup& group) {
  return GatherSequence::apply(x, &group)[0];
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, ModelParallelGroup& group) {
  return ReduceScatterSequence::apply(x, &group)[0];
}

at::Tensor replicated_weight(const at::Tensor& w, ModelParallelGroup& group) {
  return ReplicatedWeight::apply(w, &group)[0];
}

}  // namespace zb
