#include "fsdp/fsdp_collectives.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_chunk_cat.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/split_with_sizes_copy.h>
#include <ATen/ops/zeros.h>

#include <optional>

#include "float8/float8.h"


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
  if (!into.empty()) at::_foreach_copy_(into, from);  // casts fp32 -> compute dtype, one launch where CUDA can
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

at::Tensor all_gather_input_bytes(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                                  int64_t block_bytes) {
  at::NoGradGuard no_grad;
  const FSDPParam& first = *params.front();
  at::Tensor block = at::zeros({block_bytes}, first.sharded.options().dtype(at::kByte));
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam* p = params[i];
    if (p->local_rows() == 0) continue;
    const at::Tensor rows = p->sharded.detach().view({-1});
    if (p->float8_gather) {
      block.narrow(0, offsets[i], rows.numel()).copy_(
          to_float8_with_scale(rows, p->float8_scale, at::kFloat8_e4m3fn).view(at::kByte));
    } else {
      const int64_t size = static_cast<int64_t>(c10::elementSize(p->compute_dtype()));
      block.narrow(0, offsets[i], rows.numel() * size).view(p->compute_dtype()).copy_(rows);
    }
  }
  return block;
}

void all_gather_copy_out_bytes(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                               const at::Tensor& gathered, int64_t world_size) {
  at::NoGradGuard no_grad;
  const at::Tensor rows = gathered.view({world_size, -1});  // row r: rank r's block
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    p->allocate_unsharded();
    const int64_t n = p->shard.block_numel();
    if (p->float8_gather) {
      // Dequantised exactly: a power-of-two scale, and at most 4 significant bits a value.
      const at::Tensor fp8 = rows.narrow(1, offsets[i], n).contiguous().view(at::kFloat8_e4m3fn);
      p->padded_blocks().copy_(Float8Tensor{fp8, p->float8_scale.reciprocal()}.dequantised());
    } else {
      const int64_t size = static_cast<int64_t>(c10::elementSize(p->compute_dtype()));
      p->padded_blocks().copy_(rows.narrow(1, offsets[i], n * size).contiguous().view(p->compute_dtype()));
    }
  }
}

void float8_round_trip(FSDPParam& p) {
  at::NoGradGuard no_grad;
  const at::Tensor rows = p.sharded.detach().view({1, -1});
  const Float8Tensor sent{to_float8_with_scale(rows, p.float8_scale, at::kFloat8_e4m3fn), p.float8_scale.reciprocal()};
  p.padded_blocks().copy_(sent.dequantised());
}

at::Tensor reduce_scatter_input(const std::vector<FSDPParam*>& params, const std::vector<at::Tensor>& grads,
                                int64_t block_numel, int64_t world_size, int64_t averaged_over) {
  at::NoGradGuard no_grad;
  // Every gradient in one dtype (the compute dtype's, or the fp32 sums over micro-batches; fp32
  // where they differ); a missing one as zeros.
  std::optional<at::ScalarType> seen;
  for (const at::Tensor& g : grads)
    if (g.defined()) seen = !seen || *seen == g.scalar_type() ? g.scalar_type() : at::kFloat;
  const at::ScalarType dtype = seen.value_or(at::kFloat);
  std::vector<at::Tensor> whole;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool given = i < grads.size() && grads[i].defined();
    at::Tensor g = given ? grads[i] : at::zeros(params[i]->full_shape, params[i]->sharded.options().dtype(dtype));
    if (g.dim() == 0) g = g.reshape({1});  // one row, as RowShard counts it
    whole.push_back(g.to(dtype).contiguous());  // no copy where it already is
  }
  // Each gradient's rows cut into W padded blocks, block r of every parameter side by side in
  // row r (one kernel on CUDA), cast to fp32 on the way; then the pre-division for the mean.
  at::Tensor blocks = at::empty({world_size, block_numel}, whole.front().options().dtype(at::kFloat));
  at::_chunk_cat_out(blocks, whole, /*dim=*/0, world_size);
  blocks.div_(static_cast<double>(averaged_over));
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
