#include "kernels/cuda_ops.h"
#include "kernels/cuda_kernels.h"

#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/view_as_real.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <type_traits>

namespace zb::gpu {

namespace {

// x rotated by the table (or its conjugate) into a new contiguous tensor, on x's device and stream.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cis_pairs, bool conjugate) {
  at::Tensor in = x.contiguous();
  if (in.storage_offset() % 2 != 0) in = in.clone();  // pairs read as 4-byte words
  at::Tensor out = at::empty_like(in);
  const c10::cuda::CUDAGuard guard(in.device());
  C10_CUDA_CHECK(launch_rope_bf16(in.const_data_ptr(), out.mutable_data_ptr(), cis_pairs.const_data_ptr(),
                                  in.size(0) * in.size(1), in.size(1), static_cast<int>(in.size(2)),
                                  static_cast<int>(in.size(3) / 2), conjugate,
                                  c10::cuda::getCurrentCUDAStream(in.device().index()).stream()));
  return out;
}

// Autograd: the rotation is linear in x, so backward rotates the gradient by the conjugate (itself
// through this function, so that a second derivative exists) and saves nothing but the table.
struct RopeBf16 : torch::autograd::Function<RopeBf16> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cis_pairs,
                            bool conjugate) {
    ctx->saved_data["cis"] = cis_pairs;
    ctx->saved_data["conjugate"] = conjugate;
    return rotate(x, cis_pairs, conjugate);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor cis = ctx->saved_data["cis"].toTensor();
    return {RopeBf16::apply(grads[0], cis, !ctx->saved_data["conjugate"].toBool()), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// Once per device: whether this build has a kernel image for it (else ATen's operators). Read on
// every call (several per block and micro-batch): an atomic, no lock; two threads asking at once
// would both ask CUDA, with the same answer.
bool cuda_kernels_run_on(const c10::Device& device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> runs[kMaxDevices];  // 0 not asked yet, 1 runs, -1 does not
  const int d = device.index();
  if (d < 0 || d >= kMaxDevices) return false;
  int8_t known = runs[d].load(std::memory_order_relaxed);
  if (known == 0) {
    const c10::cuda::CUDAGuard guard(device);
    known = kernels_run_here() ? 1 : -1;
    runs[d].store(known, std::memory_order_relaxed);
  }
  return known > 0;
}

bool rope_cuda_bf16_applies(const at::Tensor& x, const at::Tensor& cis) {
  return x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 4 && x.size(3) % 2 == 0 &&
         cis.scalar_type() == at::kComplexFloat && cis.device() == x.device() && cis.dim() == 2 &&
         cis.size(0) >= x.size(1) && 2 * cis.size(1) == x.size(3) && x.size(2) * x.size(3) / 2 <= (1 << 30) &&
         cuda_kernels_run_on(x.device());
}

at::Tensor apply_rope_cuda_bf16(const at::Tensor& x, const at::Tensor& cis) {
  if (!rope_cuda_bf16_applies(x, cis))
    throw std::invalid_argument("apply_rope_cuda_bf16: x must be bf16 [B, T, H, Dh] on a GPU with a kernel image, "
                                "cis complex64 [>= T, Dh/2] on the same device");
  // (c, s) pairs of fp32, contiguous: [T, Dh/2, 2].
  return RopeBf16::apply(x, at::view_as_real(cis.slice(0, 0, x.size(1))).contiguous(), false);
}

bool silu_mul_cuda_bf16_applies(const at::Tensor& a, const at::Tensor& b) {
  return a.is_cuda() && a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 &&
         b.device() == a.device() && a.sizes() == b.sizes() && cuda_kernels_run_on(a.device());
}

at::Tensor silu_mul_cuda_bf16(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(silu_mul_cuda_bf16_applies(a, b), "silu_mul_cuda_bf16: a and b must be bf16 of one shape on a GPU with "
              "a kernel image");
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  at::Tensor out = at::empty_like(ca);
  const c10::cuda::CUDAGuard guard(a.device());
  C10_CUDA_CHECK(launch_silu_mul_bf16(ca.const_data_ptr(), cb.const_data_ptr(), out.mutable_data_ptr(), ca.numel(),
                                      c10::cuda::getCurrentCUDAStream(a.device().index()).stream()));
  return out;
}

std::pair<at::Tensor, at::Tensor> silu_mul_backward_cuda_bf16(const at::Tensor& g, const at::Tensor& a,
                                                              const at::Tensor& b) {
  TORCH_CHECK(silu_mul_cuda_bf16_applies(a, b) && silu_mul_cuda_bf16_applies(g, a),
              "silu_mul_backward_cuda_bf16: g, a and b must be bf16 of one shape on a GPU with a kernel image");
  const at::Tensor cg = g.contiguous(), ca = a.contiguous(), cb = b.contiguous();
  at::Tensor ga = at::empty_like(ca), gb = at::empty_like(ca);
  const c10::cuda::CUDAGuard guard(a.device());
  C10_CUDA_CHECK(launch_silu_mul_backward_bf16(cg.const_data_ptr(), ca.const_data_ptr(), cb.const_data_ptr(),
                                               ga.mutable_data_ptr(), gb.mutable_data_ptr(), ca.numel(),
                                               c10::cuda::getCurrentCUDAStream(a.device().index()).stream()));
  return {ga, gb};
}

bool float8_cast_cuda_applies(const at::Tensor& x) {
  return x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && (x.is_contiguous() || x.t().is_contiguous()) &&
         cuda_kernels_run_on(x.device());
}

std::pair<at::Tensor, at::Tensor> float8_cast_cuda(const at::Tensor& x, at::ScalarType fp8, bool rowwise,
                                                   bool power_of_two) {
  TORCH_CHECK(float8_cast_cuda_applies(x), "float8_cast_cuda: x must be a bf16 matrix (or its transpose) on a GPU "
              "with a kernel image");
  TORCH_CHECK(fp8 == at::kFloat8_e4m3fn || fp8 == at::kFloat8_e5m2, "float8_cast_cuda: not an FP8 type");
  // A transposed view's rows are the columns of the matrix under it: cast that one with column
  // scales, then transpose the bytes.
  const bool transposed = !x.is_contiguous();
  const at::Tensor m = transposed ? x.t() : x;
  const int kind = !rowwise ? kFloat8ScaleTensor : transposed ? kFloat8ScaleColumn : kFloat8ScaleRow;
  // The amaxes, one ATen reduction over the bf16 values (exact: the largest |x| is one of them),
  // then as fp32 (a value a row at most).
  const at::Tensor amax =
      (!rowwise ? at::linalg_vector_norm(m, INFINITY)
                : at::linalg_vector_norm(m, INFINITY, std::vector<int64_t>{transposed ? 0 : 1}))
          .to(at::kFloat);
  at::Tensor data = at::empty(m.sizes(), m.options().dtype(fp8));
  at::Tensor inverse = at::empty(amax.sizes(), amax.options());
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(launch_cast_to_float8_bf16(m.const_data_ptr(), amax.const_data_ptr(), kind, fp8 == at::kFloat8_e5m2,
                                            power_of_two, data.mutable_data_ptr(), inverse.mutable_data_ptr(),
                                            m.size(0), m.size(1),
                                            c10::cuda::getCurrentCUDAStream(x.device().index()).stream()));
  if (transposed) data = data.t().contiguous();
  return {data, rowwise ? inverse.view({-1, 1}) : inverse};
}

bool rms_norm_backward_cuda_bf16_applies(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& w,
                                         const at::Tensor& rstd) {
  if (!(h.is_cuda() && h.scalar_type() == at::kBFloat16 && dy.scalar_type() == at::kBFloat16 &&
        w.scalar_type() == at::kBFloat16 && rstd.scalar_type() == at::kFloat && h.dim() >= 1 &&
        dy.sizes() == h.sizes() && w.dim() == 1 && w.size(0) == h.size(-1) && rstd.numel() * h.size(-1) == h.numel() &&
        dy.device() == h.device() && w.device() == h.device() && rstd.device() == h.device() &&
        cuda_kernels_run_on(h.device())))
    return false;
  // The kernel's widths; the tensors are made contiguous and aligned by the call.
  return rms_norm_backward_bf16_takes(h.size(-1));
}

std::pair<at::Tensor, at::Tensor> rms_norm_backward_cuda_bf16(const at::Tensor& dy, const at::Tensor& h,
                                                             const at::Tensor& w, const at::Tensor& rstd,
                                                             const at::Tensor& residual) {
  TORCH_CHECK(rms_norm_backward_cuda_bf16_applies(dy, h, w, rstd), "rms_norm_backward_cuda_bf16: dy and h bf16 [.., D] "
              "with D a multiple of 8 up to 8192, w bf16 [D], rstd fp32 a value per row, on one GPU with a kernel image");
  TORCH_CHECK(!residual.defined() || (residual.sizes() == h.sizes() && residual.scalar_type() == at::kBFloat16 &&
                                      residual.device() == h.device()),
              "rms_norm_backward_cuda_bf16: the residual's gradient must be bf16 shaped as h");
  // Whole tensors from the caching allocator start 512-byte aligned; a view off alignment is copied.
  auto aligned = [](const at::Tensor& t) {
    at::Tensor c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 == 0 ? c : c.clone();
  };
  const at::Tensor cdy = aligned(dy), ch = aligned(h), cw = aligned(w), crstd = rstd.contiguous();
  const at::Tensor cres = residual.defined() ? aligned(residual) : at::Tensor();
  const int64_t D = h.size(-1), rows = h.numel() / D;
  at::Tensor dh = at::empty(h.sizes(), ch.options());
  at::Tensor partial = at::empty({rms_norm_backward_bf16_blocks(rows), D}, crstd.options());
  const c10::cuda::CUDAGuard guard(h.device());
  C10_CUDA_CHECK(launch_rms_norm_backward_bf16(cdy.const_data_ptr(), ch.const_data_ptr(), cw.const_data_ptr(),
                                               crstd.const_data_ptr(), cres.defined() ? cres.const_data_ptr() : nullptr,
                                               dh.mutable_data_ptr(), partial.mutable_data_ptr(), rows, D,
                                               c10::cuda::getCurrentCUDAStream(h.device().index()).stream()));
  return {dh, partial.sum(0).to(w.scalar_type())};
}

bool row_logsumexp_cuda_applies(const at::Tensor& z) {
  return z.is_cuda() && z.scalar_type() == at::kFloat && z.dim() == 2 && cuda_kernels_run_on(z.device());
}

at::Tensor row_logsumexp_cuda(const at::Tensor& z) {
  TORCH_CHECK(row_logsumexp_cuda_applies(z), "row_logsumexp_cuda: z must be fp32 [n, V] on one GPU with a kernel image");
  const at::Tensor cz = z.contiguous();
  at::Tensor lse = at::empty({cz.size(0), 1}, cz.options());
  const c10::cuda::CUDAGuard guard(z.device());
  C10_CUDA_CHECK(launch_row_logsumexp_fp32(cz.const_data_ptr(), lse.mutable_data_ptr(), cz.size(0), cz.size(1),
                                           c10::cuda::getCurrentCUDAStream(z.device().index()).stream()));
  return lse;
}

bool softmax_grad_cuda_bf16_applies(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets) {
  return z.is_cuda() && z.scalar_type() == at::kFloat && z.dim() == 2 && lse.scalar_type() == at::kFloat &&
         lse.numel() == z.size(0) && lse.device() == z.device() && targets.scalar_type() == at::kLong &&
         targets.numel() == z.size(0) && targets.device() == z.device() && cuda_kernels_run_on(z.device());
}

at::Tensor softmax_grad_cuda_bf16(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& targets,
                                  int64_t vocab_start) {
  TORCH_CHECK(softmax_grad_cuda_bf16_applies(z, lse, targets), "softmax_grad_cuda_bf16: z must be fp32 [n, V], lse "
              "fp32 and targets int64 of n values, on one GPU with a kernel image");
  const at::Tensor cz = z.contiguous(), clse = lse.contiguous(), ct = targets.contiguous();
  at::Tensor g = at::empty(cz.sizes(), cz.options().dtype(at::kBFloat16));
  const c10::cuda::CUDAGuard guard(z.device());
  C10_CUDA_CHECK(launch_softmax_grad_bf16(cz.const_data_ptr(), clse.const_data_ptr(), ct.const_data_ptr(), vocab_start,
                                          g.mutable_data_ptr(), cz.size(0), cz.size(1),
                                          c10::cuda::getCurrentCUDAStream(z.device().index()).stream()));
  return g;
}

bool scale_add_cuda_applies(const at::Tensor& dst, const at::Tensor& src) {
  return dst.is_cuda() && dst.scalar_type() == at::kFloat && dst.is_contiguous() &&
         (src.scalar_type() == at::kBFloat16 || src.scalar_type() == at::kFloat) && src.is_contiguous() &&
         src.sizes() == dst.sizes() && src.device() == dst.device() && cuda_kernels_run_on(dst.device());
}

void scale_add_cuda_(const at::Tensor& dst, float keep, const at::Tensor& src, float alpha, bool read) {
  TORCH_CHECK(scale_add_cuda_applies(dst, src), "scale_add_cuda_: dst must be fp32 and src bf16 or fp32, both "
              "contiguous with as many values, on one GPU with a kernel image");
  const c10::cuda::CUDAGuard guard(dst.device());
  C10_CUDA_CHECK(launch_scale_add_fp32(dst.mutable_data_ptr(), src.const_data_ptr(),
                                       src.scalar_type() == at::kBFloat16, keep, alpha, read, dst.numel(),
                                       c10::cuda::getCurrentCUDAStream(dst.device().index()).stream()));
  dst.unsafeGetTensorImpl()->bump_version();  // written in place, as ATen's in-place operators count
}

bool momentum_cuda_applies(const at::Tensor& buf, const at::Tensor& g) {
  return buf.is_cuda() && buf.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat && buf.is_contiguous() &&
         g.is_contiguous() && buf.sizes() == g.sizes() && g.device() == buf.device() &&
         cuda_kernels_run_on(buf.device());
}

void momentum_cuda_(const at::Tensor& buf, const at::Tensor& g, const at::Tensor& out, float w_buf, float w_out) {
  TORCH_CHECK(momentum_cuda_applies(buf, g) && (!out.defined() || momentum_cuda_applies(out, g)),
              "momentum_cuda_: buf, g (and out) must be fp32, contiguous, of one shape on one GPU with a kernel "
              "image");
  const c10::cuda::CUDAGuard guard(buf.device());
  C10_CUDA_CHECK(launch_momentum_fp32(buf.mutable_data_ptr(), g.const_data_ptr(),
                                      out.defined() ? out.mutable_data_ptr() : nullptr, w_buf, w_out, buf.numel(),
                                      c10::cuda::getCurrentCUDAStream(buf.device().index()).stream()));
  buf.unsafeGetTensorImpl()->bump_version();
}

namespace {

// cuBLASLt's entry points, looked up in the process: LibTorch has loaded the library (the copy in
// its wheel), and this build links no second one. `found` false: gemm_add stays with ATen.
struct CublasLt {
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) preference_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) preference_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  bool found = false;
};

const CublasLt& cublas_lt() {
  static const CublasLt lt = [] {
    CublasLt f;
    auto get = [](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(RTLD_DEFAULT, name));
      return fn != nullptr;
    };
    f.found = get(f.desc_create, "cublasLtMatmulDescCreate") && get(f.desc_set, "cublasLtMatmulDescSetAttribute") &&
              get(f.desc_destroy, "cublasLtMatmulDescDestroy") && get(f.layout_create, "cublasLtMatrixLayoutCreate") &&
              get(f.layout_set, "cublasLtMatrixLayoutSetAttribute") &&
              get(f.layout_destroy, "cublasLtMatrixLayoutDestroy") &&
              get(f.preference_create, "cublasLtMatmulPreferenceCreate") &&
              get(f.preference_set, "cublasLtMatmulPreferenceSetAttribute") &&
              get(f.preference_destroy, "cublasLtMatmulPreferenceDestroy") &&
              get(f.heuristic, "cublasLtMatmulAlgoGetHeuristic") && get(f.matmul, "cublasLtMatmul");
    return f;
  }();
  return lt;
}

void lt_check(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "gemm_add_cuda: cuBLASLt ", what, " failed with status ",
              static_cast<int>(status));
}

// A matrix [R, C] (the last two dimensions, row-major in ATen's terms) as cuBLASLt's column-major
// operand of C rows and R columns: stored as such (a row-major tensor, operation N) or as its
// transpose (a transposed view, operation T). None for other strides.
struct Operand {
  cublasOperation_t op;
  uint64_t rows, cols;  // as stored
  int64_t ld;
};
std::optional<Operand> column_major(const at::Tensor& t) {
  const int64_t R = t.size(-2), C = t.size(-1);
  if (t.stride(-1) == 1 && t.stride(-2) >= std::max<int64_t>(C, 1))
    return Operand{CUBLAS_OP_N, static_cast<uint64_t>(C), static_cast<uint64_t>(R), t.stride(-2)};
  if (t.stride(-2) == 1 && t.stride(-1) >= std::max<int64_t>(R, 1))
    return Operand{CUBLAS_OP_T, static_cast<uint64_t>(R), static_cast<uint64_t>(C), t.stride(-1)};
  return std::nullopt;
}

// The largest power of two up to 256 that divides the address: what the chosen kernel may assume.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 2 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

}  // namespace

bool gemm_add_cuda_applies(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  const int64_t d = c.dim();
  if (!c.is_cuda() || (d != 2 && d != 3) || a.dim() != d || b.dim() != d) return false;
  for (const at::Tensor* t : {&c, &a, &b})
    if (t->scalar_type() != at::kBFloat16 || t->device() != c.device() || t->numel() == 0) return false;
  if (d == 3 && (a.size(0) != c.size(0) || b.size(0) != c.size(0) || c.size(0) > INT32_MAX)) return false;
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  return b.size(-2) == K && c.size(-2) == M && c.size(-1) == N && c.stride(-1) == 1 && c.stride(-2) >= N &&
         column_major(a) && column_major(b) && cublas_lt().found;
}

at::Tensor gemm_add_cuda(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double beta, double alpha) {
  TORCH_CHECK(gemm_add_cuda_applies(c, a, b), "gemm_add_cuda: c, a, b must be bf16 on one GPU, [M, N], [M, K], "
              "[K, N] (or batched alike), a and b row-major or transposed, c row-major; cuBLASLt must be loaded");
  const c10::cuda::CUDAGuard guard(c.device());
  const CublasLt& lt = cublas_lt();
  at::Tensor out = at::empty(c.sizes(), c.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = a.size(-2), N = b.size(-1);
  // Row-major out [M, N] = a [M, K] b [K, N] is column-major out^T [N, M] = b^T [N, K] a^T [K, M]:
  // cuBLASLt's first operand is b, its second a.
  const Operand first = *column_major(b), second = *column_major(a);
  struct Handles {  // destroyed in any case
    const CublasLt& lt;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t layouts[4] = {nullptr, nullptr, nullptr, nullptr};
    cublasLtMatmulPreference_t preference = nullptr;
    ~Handles() {
      for (auto* l : layouts)
        if (l) lt.layout_destroy(l);
      if (desc) lt.desc_destroy(desc);
      if (preference) lt.preference_destroy(preference);
    }
  } h{lt};
  lt_check(lt.desc_create(&h.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  lt_check(lt.desc_set(h.desc, CUBLASLT_MATMUL_DESC_TRANSA, &first.op, sizeof(first.op)), "TRANSA");
  lt_check(lt.desc_set(h.desc, CUBLASLT_MATMUL_DESC_TRANSB, &second.op, sizeof(second.op)), "TRANSB");
  const at::Tensor* tensors[4] = {&b, &a, &c, &out};
  const uint64_t rows[4] = {first.rows, second.rows, static_cast<uint64_t>(N), static_cast<uint64_t>(N)};
  const uint64_t cols[4] = {first.cols, second.cols, static_cast<uint64_t>(M), static_cast<uint64_t>(M)};
  const int64_t lds[4] = {first.ld, second.ld, c.stride(-2), N};
  for (int i = 0; i < 4; ++i) {
    lt_check(lt.layout_create(&h.layouts[i], CUDA_R_16BF, rows[i], cols[i], lds[i]), "MatrixLayoutCreate");
    if (c.dim() == 3) {
      const int32_t count = static_cast<int32_t>(c.size(0));
      const int64_t stride = tensors[i]->stride(0);
      lt_check(lt.layout_set(h.layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)), "BATCH_COUNT");
      lt_check(lt.layout_set(h.layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
               "STRIDED_BATCH_OFFSET");
    }
  }
  const uint64_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  lt_check(lt.preference_create(&h.preference), "MatmulPreferenceCreate");
  lt_check(lt.preference_set(h.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                             sizeof(workspace_bytes)),
           "MAX_WORKSPACE_BYTES");
  const cublasLtMatmulPreferenceAttributes_t aligned[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    const uint32_t bytes = alignment(tensors[i]->const_data_ptr());
    lt_check(lt.preference_set(h.preference, aligned[i], &bytes, sizeof(bytes)), "MIN_ALIGNMENT");
  }
  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t result{};
  int results = 0;
  lt_check(lt.heuristic(handle, h.desc, h.layouts[0], h.layouts[1], h.layouts[2], h.layouts[3], h.preference, 1,
                        &result, &results),
           "MatmulAlgoGetHeuristic");
  if (results == 0) return at::Tensor();  // shapes or alignments cuBLASLt has no kernel for: ATen's
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  lt_check(lt.matmul(handle, h.desc, &alpha_f, b.const_data_ptr(), h.layouts[0], a.const_data_ptr(), h.layouts[1],
                     &beta_f, c.const_data_ptr(), h.layouts[2], out.mutable_data_ptr(), h.layouts[3], &result.algo,
                     at::cuda::getCUDABlasLtWorkspace(), workspace_bytes,
                     c10::cuda::getCurrentCUDAStream(c.device().index()).stream()),
           "Matmul");
  return out;
}

}  // namespace zb::gpu

extern "C" const zb::CudaKernelFunctions* zb_cuda_kernel_functions(std::size_t table_bytes) {
  using namespace zb::gpu;
  if (table_bytes != sizeof(zb::CudaKernelFunctions)) return nullptr;
  static const zb::CudaKernelFunctions table{
      cuda_kernels_run_on,          rope_cuda_bf16_applies,       apply_rope_cuda_bf16,
      silu_mul_cuda_bf16_applies,   silu_mul_cuda_bf16,           silu_mul_backward_cuda_bf16,
      rms_norm_backward_cuda_bf16_applies, rms_norm_backward_cuda_bf16,
      row_logsumexp_cuda_applies,   row_logsumexp_cuda,           softmax_grad_cuda_bf16_applies,
      softmax_grad_cuda_bf16,       scale_add_cuda_applies,       scale_add_cuda_,
      momentum_cuda_applies,        momentum_cuda_,               float8_cast_cuda_applies,
      float8_cast_cuda,             gemm_add_cuda_applies,        gemm_add_cuda};
  return &table;
}
