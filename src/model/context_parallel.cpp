#include "model/context_parallel.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <limits>

namespace zb {

at::Tensor cp_positions(int64_t rank, int64_t size, int64_t T, const c10::Device& device) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size && T % (2 * size) == 0, "cp_positions: rank ", rank, " of ",
              size, " for ", T, " tokens (T must divide into 2 x size chunks)");
  const int64_t c = T / (2 * size);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  return at::cat({at::arange(rank * c, (rank + 1) * c, opts), at::arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, opts)});
}

at::Tensor cp_gathered_positions(int64_t size, int64_t T, const c10::Device& device) {
  std::vector<at::Tensor> all;
  for (int64_t r = 0; r < size; ++r) all.push_back(cp_positions(r, size, T, device));
  return at::cat(all);
}

Documents cp_documents(const at::Tensor& cu_seqlens, int64_t B, int64_t T, int64_t rank, int64_t size,
                       const c10::Device& device, at::ScalarType dtype) {
  const at::Tensor mine = cp_positions(rank, size, T, device), keys = cp_gathered_positions(size, T, device);
  at::Tensor allowed = keys.unsqueeze(0).le(mine.unsqueeze(1)).unsqueeze(0).expand({B, mine.numel(), T});  // causal
  if (cu_seqlens.defined()) {
    // Document ids along the flattened rows: a 1 where each piece starts (but the first), summed.
    const at::Tensor cu = cu_seqlens.to(device);
    TORCH_CHECK(cu.scalar_type() == at::kInt && cu.numel() >= 2, "cp_documents: cumulative lengths must be int32");
    at::Tensor starts = at::zeros({B * T}, at::TensorOptions().dtype(at::kInt).device(device));
    starts.index_fill_(0, cu.slice(0, 1, -1).to(at::kLong), 1);
    const at::Tensor doc = starts.cumsum(0).view({B, T});
    allowed = allowed.logical_and(doc.index_select(1, mine).unsqueeze(2) == doc.index_select(1, keys).unsqueeze(1));
  }
  Documents d;
  d.mask = at::zeros({B, 1, mine.numel(), T}, at::TensorOptions().dtype(dtype).device(device))
               .masked_fill_(allowed.unsqueeze(1).logical_not(), -std::numeric_limits<double>::infinity());
  d.max_len = T;
  return d;
}

}  // namespace zb
