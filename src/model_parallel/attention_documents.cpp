#include "model_parallel/attention_documents.h"

#include <ATen/ops/zeros.h>

namespace zb {

at::Tensor document_ids(const at::Tensor& cu, int64_t B, int64_t T) {
  // A 1 where each piece starts (but the first), summed along the flattened rows.
  at::Tensor starts = at::zeros({B * T}, at::TensorOptions().dtype(at::kInt).device(cu.device()));
  starts.index_fill_(0, cu.slice(0, 1, -1).to(at::kLong), 1);
  return starts.cumsum(0).view({B, T});
}

}  // namespace zb
