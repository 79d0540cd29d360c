#include "fsdp/fsdp_param.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>

namespace zb {

namespace {
int64_t numel_after_dim0(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}
}  // namespace

FSDPParam::FSDPParam(std::string name_, at::Tensor* slot_, const at::Tensor& full, int64_t rank,
                     int64_t world_size, at::ScalarType compute_dtype)
    : name(std::move(name_)),
      slot(slot_),
      full_shape(full.sizes().vec()),
      rows(full.size(0)),
      row_numel(numel_after_dim0(full)),
      rows_per_rank((full.size(0) + world_size - 1) / world_size),
      local_rows(std::clamp<int64_t>(full.size(0) - rank * rows_per_rank, 0, rows_per_rank)),
      compute_dtype_(compute_dtype) {
  at::NoGradGuard no_grad;
  const int64_t start = std::min(rows, rank * rows_per_rank);  // past the end: an empty shard
  sharded = full.detach().narrow(0, start, local_rows).to(at::kFloat).clone();
  sharded.requires_grad_(true);
  unsharded_nbytes_ = static_cast<size_t>(rows * row_numel) * c10::elementSize(compute_dtype);
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

std::vector<std::pair<at::Tensor, at::Tensor>> FSDPParam::row_views(const at::Tensor& full,
                                                                    const at::Tensor& blocks,
                                                                    int64_t offset) const {
  const int64_t W = blocks.size(0);
  // Ranks [0, complete) hold rows_per_rank rows each; rank `complete` holds the remaining `rest`.
  const int64_t complete = rows / rows_per_rank, rest = rows % rows_per_rank;
  at::Tensor padded = blocks.narrow(1, offset, block_numel()).view({W, rows_per_rank, row_numel});
  at::Tensor flat = full.reshape({rows, row_numel});
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  if (complete > 0)
    out.emplace_back(flat.narrow(0, 0, complete * rows_per_rank).view({complete, rows_per_rank, row_numel}),
                     padded.narrow(0, 0, complete));
  if (rest > 0) out.emplace_back(flat.narrow(0, complete * rows_per_rank, rest), padded[complete].narrow(0, 0, rest));
  return out;
}

void FSDPParam::copy_rows_from_blocks(const at::Tensor& blocks, int64_t offset, const at::Tensor& full) const {
  for (auto& [dst, src] : row_views(full, blocks, offset)) dst.copy_(src);
}

void FSDPParam::copy_rows_to_blocks(const at::Tensor& full, const at::Tensor& blocks, int64_t offset) const {
  for (auto& [src, dst] : row_views(full, blocks, offset)) dst.copy_(src);
}

}  // namespace zb
