#include "model_parallel/expert_parallel.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>

namespace zb {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor all_to_all_rows(const at::Tensor& rows, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                           ModelParallelGroup& group) {
  const int64_t D = rows.size(1);
  int64_t received = 0;
  std::vector<int64_t> in_splits, out_splits;
  for (int64_t n : send) in_splits.push_back(n * D);
  for (int64_t n : recv) out_splits.push_back(n * D), received += n;
  at::Tensor out = at::empty({received, D}, rows.options());
  group.all_to_all(out.view(-1), rows.contiguous().view(-1), out_splits, in_splits);
  return out;
}

struct ExchangeRows : torch::autograd::Function<ExchangeRows> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& rows, const std::vector<int64_t>& send,
                               const std::vector<int64_t>& recv, ModelParallelGroup* group) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return {all_to_all_rows(rows, send, recv, *group)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<ModelParallelGroup*>(ctx->saved_data["group"].toInt());
    // The gradient of each received row goes back to the rank that sent it.
    return {all_to_all_rows(grads[0], ctx->saved_data["recv"].toIntVector(), ctx->saved_data["send"].toIntVector(),
                            *group),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor exchange_expert_counts(const at::Tensor& counts, ModelParallelGroup& group) {
  const int64_t ep = group.size(), E = counts.size(0);
  TORCH_CHECK(E % ep == 0, "expert parallelism: ", E, " experts do not divide over ", ep, " ranks");
  const at::Tensor mine = counts.to(at::kLong).contiguous();
  at::Tensor theirs = at::empty({ep, E / ep}, mine.options());
  group.all_to_all(theirs.view(-1), mine, std::vector<int64_t>(ep, E / ep), std::vector<int64_t>(ep, E / ep));
  return theirs.cpu();
}

at::Tensor exchange_rows(const at::Tensor& rows, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                         ModelParallelGroup& group) {
  return ExchangeRows::apply(rows, send, recv, &group)[0];
}

}  // namespace zb
