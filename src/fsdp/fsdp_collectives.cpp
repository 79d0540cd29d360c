#include "fsdp/fsdp_collectives.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/split_with_sizes_copy.h>
#include <ATen/ops/zeros.h>


namespace zb {

at::Tensor all_gather_input(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                            int64_t block_numel) {
  at::NoGradGuard no_grad;
  const FSDPParam& first = *params.front();
  auto opts = at::TensorOptions().dtype(first.compute_dtype()).device(first.sharded.device());
  at::Tensor block = at::zeros({block_numel}, opts);  // zeros: the padding rows
  std::vector<at::Tensor> into, from;
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam* p = params[i];
    if (p->local_rows() == 0) continue;
    into.push_back(block.narrow(0, offsets[i], p->sharded.numel()));
    from.push_back(p->sharded.detach().view({-1}));
  }
  at::_foreach_copy_(into, from);  // casts fp32 -> compute dtype, in one launch where CUDA can
  return block;
}

void all_gather_copy_out(const std::vector<FSDPParam*>& params, const at::Tensor& gathered, int64_t world_size) {
  at::NoGradGuard no_grad;
  // Row r of the gathered [W, block] buffer is rank r's block, the parameters' padded blocks side
  // by side: split along the row, each piece is a parameter's storage exactly (one kernel on CUDA).
  std::vector<at::Tensor> storages;
  std::vector<int64_t> sizes;
  for (FSDPParam* p : params) {
    p->allocate_unsharded();
    storages.push_back(p->padded_blocks());
    sizes.push_back(p->shard.block_numel());
  }
  at::split_with_sizes_copy_out(storages, gathered.view({world_size, -1}), sizes, /*dim=*/1);
}

at::Tensor reduce_scatter_input(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                                const std::vector<at::Tensor>& grads, int64_t block_numel,
                                int64_t world_size, int64_t replicas) {
  at::NoGradGuard no_grad;
  const auto device = params.front()->sharded.device();
  at::Tensor blocks = at::zeros({world_size, block_numel}, at::TensorOptions().device(device));
  for (size_t i = 0; i < params.size(); ++i)
    if (i < grads.size() && grads[i].defined())
      copy_full_to_blocks(params[i]->shard, grads[i], blocks, offsets[i]);  // casts to fp32
  blocks.div_(static_cast<double>(world_size * replicas));
  return blocks.view({-1});
}

void reduce_scatter_copy_out(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                             const at::Tensor& reduced) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    at::Tensor g = reduced.narrow(0, offsets[i], p->sharded.numel()).view(p->sharded.sizes());
    at::Tensor& grad = p->sharded.mutable_grad();
    if (grad.defined()) grad.add_(g);
    else grad = g.clone();
  }
}

}  // namespace zb
