// SwiGLU's gate, silu(a) * b, on bf16 in one pass over memory each way. ATen's operators make it
// in two passes forward (silu, then mul: 5 tensor reads and writes) and three backward (g * b,
// SiLU's backward, g * silu(a): 9), each a tensor the size of the MLP's hidden layer; here 3
// forward and 5 backward. The numbers are ATen's: each operator's result rounded to bf16 where
// ATen rounds it (SiLU's output before the product, g * b before SiLU's backward), the arithmetic
// in fp32 in ATen's order. Plain CUDA: no LibTorch headers here.
#include "kernels/cuda_kernels.h"
#include "kernels/device_helpers.cuh"

// In zb: the profiler counts kernels named zb:: as ours (observe/profiler.h, kernel_kind).
namespace zb {
namespace {
using namespace device;

constexpr int kVector = 8;  // bf16 values per 16-byte access (Bf16x8)

// ATen's SiLU forward: x / (1 + e^-x).
ZB_HD float silu(float x) { return x / (1.0f + expf(-x)); }

ZB_HD __nv_bfloat16 silu_mul(__nv_bfloat16 a, __nv_bfloat16 b) { return bf16(f(bf16(silu(f(a)))) * f(b)); }

// The product's rule, then SiLU's (ATen's: dy * s * (1 + x * (1 - s)), s the sigmoid).
ZB_HD void silu_mul_backward(__nv_bfloat16 g, __nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16& ga,
                             __nv_bfloat16& gb) {
  const float x = f(a), s = 1.0f / (1.0f + expf(-x));
  ga = bf16(f(bf16(f(g) * f(b))) * s * (1.0f + x * (1.0f - s)));
  gb = bf16(f(g) * f(bf16(silu(x))));
}

// One thread's grid-stride loops (`first`: its index in the grid; `stride`: the grid's threads):
// 16-byte vectors where every pointer is 16-byte aligned, then single values for what is left. A
// pointer off alignment sends the whole tensor through single values (slower, still correct); the
// model's tensors come from the caching allocator and GEMMs, aligned.
ZB_HD void silu_mul_thread(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                           __nv_bfloat16* __restrict__ out, int64_t n, bool vectors, int64_t first, int64_t stride) {
  const int64_t n_vectors = vectors ? n / kVector : 0;
  for (int64_t v = first; v < n_vectors; v += stride) {
    const Bf16x8 va = reinterpret_cast<const Bf16x8*>(a)[v], vb = reinterpret_cast<const Bf16x8*>(b)[v];
    Bf16x8 vo;
#pragma unroll
    for (int k = 0; k < kVector; ++k) vo.v[k] = silu_mul(va.v[k], vb.v[k]);
    reinterpret_cast<Bf16x8*>(out)[v] = vo;
  }
  for (int64_t i = n_vectors * kVector + first; i < n; i += stride) out[i] = silu_mul(a[i], b[i]);
}

ZB_HD void silu_mul_backward_thread(const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ a,
                                    const __nv_bfloat16* __restrict__ b, __nv_bfloat16* __restrict__ ga,
                                    __nv_bfloat16* __restrict__ gb, int64_t n, bool vectors, int64_t first,
                                    int64_t stride) {
  const int64_t n_vectors = vectors ? n / kVector : 0;
  for (int64_t v = first; v < n_vectors; v += stride) {
    const Bf16x8 vg = reinterpret_cast<const Bf16x8*>(g)[v], va = reinterpret_cast<const Bf16x8*>(a)[v],
                 vb = reinterpret_cast<const Bf16x8*>(b)[v];
    Bf16x8 vga, vgb;
#pragma unroll
    for (int k = 0; k < kVector; ++k) silu_mul_backward(vg.v[k], va.v[k], vb.v[k], vga.v[k], vgb.v[k]);
    reinterpret_cast<Bf16x8*>(ga)[v] = vga;
    reinterpret_cast<Bf16x8*>(gb)[v] = vgb;
  }
  for (int64_t i = n_vectors * kVector + first; i < n; i += stride) silu_mul_backward(g[i], a[i], b[i], ga[i], gb[i]);
}

__global__ void silu_mul_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                              __nv_bfloat16* __restrict__ out, int64_t n, bool vectors) {
  silu_mul_thread(a, b, out, n, vectors, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                  static_cast<int64_t>(gridDim.x) * blockDim.x);
}

__global__ void silu_mul_backward_bf16(const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ a,
                                       const __nv_bfloat16* __restrict__ b, __nv_bfloat16* __restrict__ ga,
                                       __nv_bfloat16* __restrict__ gb, int64_t n, bool vectors) {
  silu_mul_backward_thread(g, a, b, ga, gb, n, vectors, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                           static_cast<int64_t>(gridDim.x) * blockDim.x);
}

}  // namespace


cudaError_t launch_silu_mul_bf16(const void* a, const void* b, void* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vectors = aligned(a) && aligned(b) && aligned(out);
  silu_mul_bf16<<<grid_for(n, kVector, vectors), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(a),
                                                          static_cast<const __nv_bfloat16*>(b),
                                                          static_cast<__nv_bfloat16*>(out), n, vectors);
  return cudaGetLastError();
}

cudaError_t launch_silu_mul_backward_bf16(const void* g, const void* a, const void* b, void* ga, void* gb, int64_t n,
                                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vectors = aligned(g) && aligned(a) && aligned(b) && aligned(ga) && aligned(gb);
  silu_mul_backward_bf16<<<grid_for(n, kVector, vectors), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b),
      static_cast<__nv_bfloat16*>(ga), static_cast<__nv_bfloat16*>(gb), n, vectors);
  return cudaGetLastError();
}

// The launches' work on the host, every thread of the grid in turn (`threads`; 0: the grid the
// launch would use).
void silu_mul_bf16_on_host(const void* a, const void* b, void* out, int64_t n, int64_t threads) {
  const bool vectors = aligned(a) && aligned(b) && aligned(out);
  if (threads == 0) threads = static_cast<int64_t>(grid_for(n, kVector, vectors).x) * 256;
  for (int64_t t = 0; t < threads; ++t)
    silu_mul_thread(static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b),
                    static_cast<__nv_bfloat16*>(out), n, vectors, t, threads);
}

void silu_mul_backward_bf16_on_host(const void* g, const void* a, const void* b, void* ga, void* gb, int64_t n,
                                    int64_t threads) {
  const bool vectors = aligned(g) && aligned(a) && aligned(b) && aligned(ga) && aligned(gb);
  if (threads == 0) threads = static_cast<int64_t>(grid_for(n, kVector, vectors).x) * 256;
  for (int64_t t = 0; t < threads; ++t)
    silu_mul_backward_thread(static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(a),
                             static_cast<const __nv_bfloat16*>(b), static_cast<__nv_bfloat16*>(ga),
                             static_cast<__nv_bfloat16*>(gb), n, vectors, t, threads);
}

}  // namespace zb
