// The fp32 tensors a step keeps (gradient sums, Muon's momentum, the master weights) updated in one
// pass each. ATen's path on a 1B step on an H100: the mixed-dtype add (fp32 += bf16) runs
// unvectorized, 9.6 ms a step for the gradient sums and Muon's update; the first micro-batch's
// copy to fp32 likewise (4.0 ms); weight decay is a pass of its own (2.8 ms), and Muon's momentum
// two lerps (8.2 ms). The numbers are ATen's:
//   scale_add: dst = fma(alpha, src, dst * keep), dst * keep rounded first as the multiply by
//     the decay, then one rounding (keep 1: dst + alpha * src, ATen's add_; and with `read` false,
//     alpha * src, dst unread);
//   momentum: buf = lerp(buf, g, w_buf); with nesterov also out = lerp(g, buf, w_out), ATen's lerp
//     (a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w)); Muon's weights are 1 - mu and mu,
//     each rounded to fp32 from the double (as ATen's scalar; 1.0f - float(mu) would differ).
// Plain CUDA: no LibTorch headers here.
#include "kernels/cuda_kernels.h"
#include "kernels/device_helpers.cuh"

#include <cmath>

// In zb: the profiler counts kernels named zb:: as ours (observe/profiler.h, kernel_kind).
namespace zb {
namespace {
using namespace device;

constexpr int kVector = 4;  // fp32 values per 16-byte access (and bf16 per 8-byte one: Bf16x4)

struct alignas(16) F32x4 {
  float v[kVector];
};

template <typename Src>
struct VectorOf;
template <>
struct VectorOf<float> {
  using type = F32x4;
};
template <>
struct VectorOf<__nv_bfloat16> {
  using type = Bf16x4;
};

// The decay's multiply is its own rounding (as the separate pass it replaces), then one fused
// multiply-add.
ZB_HD float scale_add(float dst, float src, float keep, float alpha, bool read) {
  return read ? fmaf(alpha, src, dst * keep) : alpha * src;
}

ZB_HD float lerp(float a, float b, float w) {
  return fabsf(w) < 0.5f ? fmaf(w, b - a, a) : fmaf(-(b - a), 1.0f - w, b);
}

// One thread's grid-stride loops (`first`: its index in the grid; `stride`: the grid's threads):
// vectors where every pointer is aligned, then single values for what is left.
template <typename Src>
ZB_HD void scale_add_thread(float* __restrict__ dst, const Src* __restrict__ src, float keep, float alpha, bool read,
                            int64_t n, bool vectors, int64_t first, int64_t stride) {
  using V = typename VectorOf<Src>::type;
  const int64_t n_vectors = vectors ? n / kVector : 0;
  for (int64_t v = first; v < n_vectors; v += stride) {
    const V s = reinterpret_cast<const V*>(src)[v];
    F32x4 d{};
    if (read) d = reinterpret_cast<const F32x4*>(dst)[v];
#pragma unroll
    for (int k = 0; k < kVector; ++k) d.v[k] = scale_add(d.v[k], f(s.v[k]), keep, alpha, read);
    reinterpret_cast<F32x4*>(dst)[v] = d;
  }
  for (int64_t i = n_vectors * kVector + first; i < n; i += stride)
    dst[i] = scale_add(read ? dst[i] : 0.0f, f(src[i]), keep, alpha, read);
}

ZB_HD void momentum_thread(float* __restrict__ buf, const float* __restrict__ g, float* __restrict__ out, float w_buf,
                           float w_out, int64_t n, bool vectors, int64_t first, int64_t stride) {
  const int64_t n_vectors = vectors ? n / kVector : 0;
  for (int64_t v = first; v < n_vectors; v += stride) {
    F32x4 b = reinterpret_cast<const F32x4*>(buf)[v];
    const F32x4 gv = reinterpret_cast<const F32x4*>(g)[v];
    F32x4 o;
#pragma unroll
    for (int k = 0; k < kVector; ++k) {
      b.v[k] = lerp(b.v[k], gv.v[k], w_buf);
      o.v[k] = lerp(gv.v[k], b.v[k], w_out);
    }
    reinterpret_cast<F32x4*>(buf)[v] = b;
    if (out) reinterpret_cast<F32x4*>(out)[v] = o;
  }
  for (int64_t i = n_vectors * kVector + first; i < n; i += stride) {
    buf[i] = lerp(buf[i], g[i], w_buf);
    if (out) out[i] = lerp(g[i], buf[i], w_out);
  }
}

template <typename Src>
__global__ void scale_add_fp32(float* __restrict__ dst, const Src* __restrict__ src, float keep, float alpha,
                               bool read, int64_t n, bool vectors) {
  scale_add_thread(dst, src, keep, alpha, read, n, vectors,
                   static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                   static_cast<int64_t>(gridDim.x) * blockDim.x);
}

__global__ void momentum_fp32(float* __restrict__ buf, const float* __restrict__ g, float* __restrict__ out,
                              float w_buf, float w_out, int64_t n, bool vectors) {
  momentum_thread(buf, g, out, w_buf, w_out, n, vectors, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                  static_cast<int64_t>(gridDim.x) * blockDim.x);
}

template <typename Src>
bool scale_add_vectors(const void* dst, const void* src) {
  return aligned(dst, 16) && aligned(src, static_cast<int>(kVector * sizeof(Src)));
}

template <typename Src>
void scale_add_on_host(void* dst, const void* src, float keep, float alpha, bool read, int64_t n, int64_t threads) {
  const bool vectors = scale_add_vectors<Src>(dst, src);
  if (threads == 0) threads = static_cast<int64_t>(grid_for(n, kVector, vectors).x) * 256;
  for (int64_t t = 0; t < threads; ++t)
    scale_add_thread(static_cast<float*>(dst), static_cast<const Src*>(src), keep, alpha, read, n, vectors, t,
                     threads);
}

}  // namespace

cudaError_t launch_scale_add_fp32(void* dst, const void* src, bool src_bf16, float keep, float alpha, bool read,
                                  int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (src_bf16) {
    const bool vectors = scale_add_vectors<__nv_bfloat16>(dst, src);
    scale_add_fp32<<<grid_for(n, kVector, vectors), 256, 0, stream>>>(
        static_cast<float*>(dst), static_cast<const __nv_bfloat16*>(src), keep, alpha, read, n, vectors);
  } else {
    const bool vectors = scale_add_vectors<float>(dst, src);
    scale_add_fp32<<<grid_for(n, kVector, vectors), 256, 0, stream>>>(static_cast<float*>(dst), static_cast<const float*>(src),
                                                             keep, alpha, read, n, vectors);
  }
  return cudaGetLastError();
}

cudaError_t launch_momentum_fp32(void* buf, const void* g, void* out, float w_buf, float w_out, int64_t n,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vectors = aligned(buf, 16) && aligned(g, 16) && aligned(out, 16);
  momentum_fp32<<<grid_for(n, kVector, vectors), 256, 0, stream>>>(static_cast<float*>(buf), static_cast<const float*>(g),
                                                          static_cast<float*>(out), w_buf, w_out, n, vectors);
  return cudaGetLastError();
}

void scale_add_fp32_on_host(void* dst, const void* src, bool src_bf16, float keep, float alpha, bool read, int64_t n,
                            int64_t threads) {
  if (src_bf16)
    scale_add_on_host<__nv_bfloat16>(dst, src, keep, alpha, read, n, threads);
  else
    scale_add_on_host<float>(dst, src, keep, alpha, read, n, threads);
}

void momentum_fp32_on_host(void* buf, const void* g, void* out, float w_buf, float w_out, int64_t n,
                           int64_t threads) {
  const bool vectors = aligned(buf, 16) && aligned(g, 16) && aligned(out, 16);
  if (threads == 0) threads = static_cast<int64_t>(grid_for(n, kVector, vectors).x) * 256;
  for (int64_t t = 0; t < threads; ++t)
    momentum_thread(static_cast<float*>(buf), static_cast<const float*>(g), static_cast<float*>(out), w_buf, w_out,
                    n, vectors, t, threads);
}

}  // namespace zb
