// RoPE on bf16 q or k in one pass over memory (issue 26, item 7). The unfused path
// (model/layers.cpp) reads bf16, writes and reads an fp32 copy, multiplies, writes fp32 and casts
// back: about 20 bytes of traffic per element each way, against 4 here. The arithmetic is the
// unfused path's: each adjacent pair (x0, x1) as x0 + j x1 in fp32, times the fp32 table entry
// c + j s, rounded to bf16 to nearest even. Backward is the same rotation by the conjugate
// (c - j s), as autograd takes the unfused product's. Plain CUDA: no LibTorch headers here.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

// One thread per pair of x [B, T, H, 2 * half] (contiguous); the table cis is [T, half] pairs
// (c, s) of fp32. `sign` is +1 forward, -1 for the conjugate.
__global__ void rope_bf16(const __nv_bfloat162* x, __nv_bfloat162* out, const float2* cis, int64_t pairs,
                          int64_t T, int64_t heads, int64_t half, float sign) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs; i += stride) {
    const int64_t p = i % half, t = (i / (half * heads)) % T;
    const float2 e = cis[t * half + p];
    const float c = e.x, s = sign * e.y;
    const float2 v = __bfloat1622float2(x[i]);
    // (a + jb)(c + js) = (ac - bs) + j(as + bc), in the order c10::complex writes it.
    out[i] = __floats2bfloat162_rn(v.x * c - v.y * s, v.x * s + v.y * c);
  }
}

}  // namespace

namespace zb {

// Rotates `pairs` bf16 pairs of x into out on `stream`; the launch's error, if any.
cudaError_t launch_rope_bf16(const void* x, void* out, const void* cis, int64_t pairs, int64_t T, int64_t heads,
                             int64_t half, bool conjugate, cudaStream_t stream) {
  if (pairs == 0) return cudaSuccess;
  const int threads = 256;
  // Enough blocks to fill any current GPU several times over; the loop covers the rest.
  const int64_t wanted = (pairs + threads - 1) / threads;
  const int blocks = static_cast<int>(wanted < 65536 ? wanted : 65536);
  rope_bf16<<<blocks, threads, 0, stream>>>(static_cast<const __nv_bfloat162*>(x), static_cast<__nv_bfloat162*>(out),
                                            static_cast<const float2*>(cis), pairs, T, heads, half,
                                            conjugate ? -1.0f : 1.0f);
  return cudaGetLastError();
}

}  // namespace zb
