#include "fsdp/fsdp_param.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>


namespace zb {

FSDPParam::FSDPParam(std::string name_, at::Tensor* slot_, const at::Tensor& full, int64_t rank_,
                     int64_t world_size, at::ScalarType compute_dtype)
    : name(std::move(name_)),
      slot(slot_),
      full_shape(full.sizes().vec()),
      shard(RowShard::of(full_shape, world_size)),
      rank(rank_),
      compute_dtype_(compute_dtype) {
  at::NoGradGuard no_grad;
  sharded = full.detach().narrow(0, first_row(), local_rows()).to(at::kFloat).clone();
  sharded.requires_grad_(true);
  unsharded_nbytes_ = static_cast<size_t>(world_size * shard.block_numel()) * c10::elementSize(compute_dtype);
  storage_ = c10::Storage(c10::Storage::use_byte_size_t(), 0,
                          c10::GetAllocator(full.device().type()), /*resizable=*/true);
}

void FSDPParam::allocate_unsharded() {
  if (unsharded_allocated()) return;
  auto* impl = storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(unsharded_nbytes_));
  impl->set_nbytes(unsharded_nbytes_);
}

void FSDPParam::free_unsharded() {
  auto* impl = storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->data_ptr().device()));
  impl->set_nbytes(0);
}

at::Tensor FSDPParam::unsharded_view() const {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(compute_dtype_).device(sharded.device()));
  std::vector<int64_t> strides(full_shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(full_shape.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * full_shape[d + 1];
  return t.set_(storage_, 0, full_shape, strides);
}

int64_t FSDPParam::gather_bytes() const {
  const int64_t bytes = shard.block_numel() * (float8_gather ? 1 : static_cast<int64_t>(c10::elementSize(compute_dtype_)));
  return (bytes + 15) / 16 * 16;
}

at::Tensor FSDPParam::padded_blocks() const {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(compute_dtype_).device(sharded.device()));
  return t.set_(storage_, 0, {shard.world_size, shard.block_numel()}, {shard.block_numel(), 1});
}

}  // namespace zb
