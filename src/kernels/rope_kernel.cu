// RoPE on bf16 q or k in one pass over memory (issue 26, item 7). The unfused path
// (model/layers.cpp) reads bf16, writes and reads an fp32 copy, multiplies, writes fp32 and casts
// back: about 20 bytes of traffic per element each way, against 4 here. The arithmetic is the
// unfused path's: each adjacent pair (x0, x1) as x0 + j x1 in fp32, times the fp32 table entry
// c + j s, rounded to bf16 to nearest even. Backward is the same rotation by the conjugate
// (c - j s), as autograd takes the unfused product's. Plain CUDA: no LibTorch headers here.
#include "kernels/cuda_kernels.h"
#include "kernels/device_helpers.cuh"

#include <cuda_bf16.h>

// In zb: the profiler counts kernels named zb:: as ours (observe/profiler.h, kernel_kind).
namespace zb {
namespace {
using namespace device;

// A block per position (b, t) at a time: its heads x half pairs are contiguous in x [B, T, H, 2 half]
// and all read the table's row t, so the division by T happens once per row and the pair's index
// within a head is a 32-bit remainder. Four pairs a thread at a time (16-byte accesses) where a
// head's pairs come in fours and the pointers are 16-byte aligned (`vectors`), else one (4-byte
// accesses ran at 2.2 TB/s on an H100). One thread's loops (`block` of `blocks`, `thread` of
// `threads` in it), host and device: the tests also run them on the CPU (rope_bf16_on_host).
struct alignas(16) Pairs4 {
  __nv_bfloat162 p[4];
};
struct alignas(16) Table2 {
  float2 e[2];
};

// (a + jb)(c + js) = (ac - bs) + j(as + bc), in the order c10::complex writes it.
ZB_HD __nv_bfloat162 rotate_pair(__nv_bfloat162 x, float2 e, float sign) {
  const float c = e.x, s = sign * e.y;
  const float2 v = __bfloat1622float2(x);
  return __floats2bfloat162_rn(v.x * c - v.y * s, v.x * s + v.y * c);
}

ZB_HD void rope_thread(const __nv_bfloat162* __restrict__ x,
                                                     __nv_bfloat162* __restrict__ out, const float2* __restrict__ cis,
                                                     int64_t rows, int64_t T, int pairs_per_row, int half, float sign,
                                                     bool vectors, int64_t block, int64_t blocks, int thread,
                                                     int threads) {
  for (int64_t r = block; r < rows; r += blocks) {
    const float2* table = cis + (r % T) * half;
    const __nv_bfloat162* in = x + r * pairs_per_row;
    __nv_bfloat162* o = out + r * pairs_per_row;
    if (vectors) {
      const int fours = pairs_per_row / 4, head_fours = half / 4;
      for (int j = thread; j < fours; j += threads) {
        const Pairs4 v = reinterpret_cast<const Pairs4*>(in)[j];
        const Table2* t = reinterpret_cast<const Table2*>(table) + 2 * (j % head_fours);
        const Table2 t0 = t[0], t1 = t[1];
        Pairs4 w;
        w.p[0] = rotate_pair(v.p[0], t0.e[0], sign);
        w.p[1] = rotate_pair(v.p[1], t0.e[1], sign);
        w.p[2] = rotate_pair(v.p[2], t1.e[0], sign);
        w.p[3] = rotate_pair(v.p[3], t1.e[1], sign);
        reinterpret_cast<Pairs4*>(o)[j] = w;
      }
    } else {
      for (int j = thread; j < pairs_per_row; j += threads) o[j] = rotate_pair(in[j], table[j % half], sign);
    }
  }
}

__global__ void rope_bf16(const __nv_bfloat162* __restrict__ x, __nv_bfloat162* __restrict__ out,
                          const float2* __restrict__ cis, int64_t rows, int64_t T, int pairs_per_row, int half,
                          float sign, bool vectors) {
  rope_thread(x, out, cis, rows, T, pairs_per_row, half, sign, vectors, blockIdx.x, gridDim.x, threadIdx.x,
              blockDim.x);
}

bool rope_vectors(const void* x, const void* out, const void* cis, int half) {
  return half % 4 == 0 && aligned(x) && aligned(out) && aligned(cis);
}

// The launch's grid: a block per row up to 2^20 blocks (the loop covers the rest), and up to 256
// threads a block, whole warps, for the row's pairs or fours of pairs.
struct RopeGrid {
  int blocks, threads;
};
RopeGrid rope_grid(int64_t rows, int pairs_per_row, bool vectors) {
  const int work = vectors ? pairs_per_row / 4 : pairs_per_row;
  return {static_cast<int>(rows < (1 << 20) ? rows : (1 << 20)), work >= 256 ? 256 : ((work + 31) / 32) * 32};
}

}  // namespace


cudaError_t launch_rope_bf16(const void* x, void* out, const void* cis, int64_t rows, int64_t T, int heads, int half,
                             bool conjugate, cudaStream_t stream) {
  if (rows == 0 || heads == 0 || half == 0) return cudaSuccess;
  const int pairs_per_row = heads * half;
  const bool vectors = rope_vectors(x, out, cis, half);
  const RopeGrid grid = rope_grid(rows, pairs_per_row, vectors);
  rope_bf16<<<grid.blocks, grid.threads, 0, stream>>>(static_cast<const __nv_bfloat162*>(x),
                                                      static_cast<__nv_bfloat162*>(out),
                                                      static_cast<const float2*>(cis), rows, T, pairs_per_row, half,
                                                      conjugate ? -1.0f : 1.0f, vectors);
  return cudaGetLastError();
}

void rope_bf16_on_host(const void* x, void* out, const void* cis, int64_t rows, int64_t T, int heads, int half,
                       bool conjugate, int64_t blocks, int threads) {
  if (rows == 0 || heads == 0 || half == 0) return;
  const int pairs_per_row = heads * half;
  const bool vectors = rope_vectors(x, out, cis, half);
  const RopeGrid grid = rope_grid(rows, pairs_per_row, vectors);
  if (blocks == 0) blocks = grid.blocks;
  if (threads == 0) threads = grid.threads;
  for (int64_t block = 0; block < blocks; ++block)
    for (int thread = 0; thread < threads; ++thread)
      rope_thread(static_cast<const __nv_bfloat162*>(x), static_cast<__nv_bfloat162*>(out),
                  static_cast<const float2*>(cis), rows, T, pairs_per_row, half, conjugate ? -1.0f : 1.0f, vectors,
                  block, blocks, thread, threads);
}

bool kernels_run_here() {
  cudaFuncAttributes attributes;
  const bool ok = cudaFuncGetAttributes(&attributes, rope_bf16) == cudaSuccess;
  if (!ok) cudaGetLastError();  // clear "no kernel image" so that it is not reported later
  return ok;
}

}  // namespace zb
