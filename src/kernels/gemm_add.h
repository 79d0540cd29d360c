#pragma once
// beta * c + alpha * a b as one GEMM that reads c in its epilogue and writes a new tensor.
//
// ATen's addmm and baddbmm add their term by copying it into the output and then running the GEMM
// with beta over it: two passes over memory before the GEMM starts. On a GPU in bf16 cuBLASLt takes
// c and the output as two matrices, so c is read once, by the GEMM. In the 1B step on an H100 the
// copies were 9.5 ms in Newton-Schulz and 6.3 ms in the residual GEMMs (2026-11-26).
#include <ATen/core/Tensor.h>

namespace zb {

// a [M, K], b [K, N], c [M, N], or each with a leading batch dimension (one size for all three);
// a and b may be transposed views. Returns beta * c + alpha * a b, contiguous, in c's dtype. With
// through_cublaslt, by cuBLASLt where gemm_add_cuda_applies (kernels/cuda_ops.h) and it has a kernel
// for the shapes; else ATen's addmm / baddbmm. No autograd.
at::Tensor gemm_add(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double beta, double alpha,
                    bool through_cublaslt);

}  // namespace zb
