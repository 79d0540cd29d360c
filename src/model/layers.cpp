#include "model/layers.h"
#ifdef ZB_WITH_CUDA
#include "model/rope_cuda.h"
#endif

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/view_as_complex.h>
#include <ATen/ops/view_as_real.h>

namespace zb {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // at::rms_norm accumulates reduced-precision inputs in fp32 and uses a fused kernel on CUDA.
  return at::rms_norm(x, {x.size(-1)}, weight.to(x.scalar_type()), eps);
}

RopeTables rope_tables(int64_t head_dim, int64_t max_positions, double theta,
                       const at::TensorOptions& options) {
  // fp32 tables, as ZeroBand's; float64 when the model itself is float64.
  auto f32 = options.dtype(options.has_dtype() && options.dtype() == at::kDouble ? at::kDouble : at::kFloat);
  // freq_i = theta^(-2i/head_dim), i = 0 .. head_dim/2 - 1
  at::Tensor exponents = at::arange(0, head_dim, 2, f32) / static_cast<double>(head_dim);
  at::Tensor freqs = at::pow(theta, exponents).reciprocal();
  at::Tensor angles = at::outer(at::arange(max_positions, f32), freqs);
  // cos + j sin, built as (cos, sin) pairs: at::polar has no meta-device kernel (dry runs).
  return {at::view_as_complex(at::stack({at::cos(angles), at::sin(angles)}, -1))};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {
#ifdef ZB_WITH_CUDA
  // The unfused path moves about five times the bytes of q and k through memory (fp32 copies).
  if (rope_cuda_bf16_applies(x, rope.cis)) return apply_rope_cuda_bf16(x, rope.cis);
#endif
  return apply_rope_unfused(x, rope);
}

at::Tensor apply_rope_unfused(const at::Tensor& x, const RopeTables& rope) {
  const int64_t T = x.size(1), half = x.size(3) / 2;
  // One complex multiply per pair (a single elementwise kernel each way, where the cos/sin form
  // took six): fp32 arithmetic for reduced-precision inputs; float64 stays float64.
  const auto work = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor pairs = at::view_as_complex(x.to(work).unflatten(-1, {half, 2}));
  at::Tensor cis = rope.cis.slice(0, 0, T).view({1, T, 1, half});  // broadcast over batch, heads
  return at::view_as_real(pairs * cis).flatten(-2).to(x.scalar_type());
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3) {
  return at::linear(at::silu(at::linear(x, w1)) * at::linear(x, w3), w2);
}

}  // namespace zb
