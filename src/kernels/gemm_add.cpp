#include "kernels/gemm_add.h"

#ifdef ZB_WITH_CUDA
#include "kernels/cuda_ops.h"
#endif

#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>

namespace zb {

at::Tensor gemm_add(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double beta, double alpha,
                    bool through_cublaslt) {
#ifdef ZB_WITH_CUDA
  if (through_cublaslt && gemm_add_cuda_applies(c, a, b)) {
    at::Tensor out = gemm_add_cuda(c, a, b, beta, alpha);
    if (out.defined()) return out;
  }
#else
  (void)through_cublaslt;
#endif
  return c.dim() == 2 ? at::addmm(c, a, b, beta, alpha) : at::baddbmm(c, a, b, beta, alpha);
}

}  // namespace zb
