// The chunked loss's gradient of its logits (model/chunked_loss.cpp) in one pass over memory: from
// the fp32 logits z [n, V] and each row's log-sum-exp, softmax(z) - onehot(target) rounded to bf16
// for the two GEMMs that follow. ATen's operators make it in three passes (z - lse in place, exp in
// place, the cast to bf16: 22 bytes of traffic per element) where this reads 4 bytes and writes 2.
// The numbers are theirs: expf(z - lse) in fp32, then -1 added at the target, then rounded to the
// nearest bf16, even on ties. Plain CUDA: no LibTorch headers here.
#include "model/cuda_kernels.h"

#include <cuda_bf16.h>

// In zb: the profiler counts kernels named zb:: as ours (train/profiler.h, kernel_kind).
namespace zb {
namespace {

// Four bf16 values stored as one 8-byte access.
struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};

// One row of z per block at a time: the row's log-sum-exp and target are read once. The column of
// the target here is target - vocab_start (under a vocabulary split over ranks, a word of another
// rank's falls outside [0, V) and gets no one-hot). Columns go four at a time (a 16-byte read, an
// 8-byte write) where V is a multiple of 4 and the pointers aligned, else one at a time. One
// thread's loops (`block` of `blocks`, `thread` of `threads` in it), host and device: the tests
// also run them on the CPU (softmax_grad_bf16_on_host).
__host__ __device__ __forceinline__ void softmax_grad_thread(const float* __restrict__ z, const float* __restrict__ lse,
                                                             const int64_t* __restrict__ targets, int64_t vocab_start,
                                                             __nv_bfloat16* __restrict__ g, int64_t rows, int64_t V,
                                                             bool vectors, int64_t block, int64_t blocks, int thread,
                                                             int threads) {
  for (int64_t r = block; r < rows; r += blocks) {
    const float m = lse[r];
    const int64_t target = targets[r] - vocab_start;
    const float* zr = z + r * V;
    __nv_bfloat16* gr = g + r * V;
    const int64_t n_vectors = vectors ? V / 4 : 0;
    for (int64_t j = thread; j < n_vectors; j += threads) {
      const float4 v = reinterpret_cast<const float4*>(zr)[j];
      float e0 = expf(v.x - m), e1 = expf(v.y - m), e2 = expf(v.z - m), e3 = expf(v.w - m);
      const int64_t c = 4 * j;  // named lanes, not an array indexed at run time (kept in registers)
      if (target == c) e0 += -1.0f;
      else if (target == c + 1) e1 += -1.0f;
      else if (target == c + 2) e2 += -1.0f;
      else if (target == c + 3) e3 += -1.0f;
      reinterpret_cast<Bf16x4*>(gr + c)[0] = {__floats2bfloat162_rn(e0, e1), __floats2bfloat162_rn(e2, e3)};
    }
    for (int64_t c = n_vectors * 4 + thread; c < V; c += threads) {
      float e = expf(zr[c] - m);
      if (c == target) e += -1.0f;
      gr[c] = __float2bfloat16_rn(e);
    }
  }
}

__global__ void softmax_grad_bf16(const float* __restrict__ z, const float* __restrict__ lse,
                                  const int64_t* __restrict__ targets, int64_t vocab_start,
                                  __nv_bfloat16* __restrict__ g, int64_t rows, int64_t V, bool vectors) {
  softmax_grad_thread(z, lse, targets, vocab_start, g, rows, V, vectors, blockIdx.x, gridDim.x, threadIdx.x,
                      blockDim.x);
}

bool vectors_apply(const void* z, const void* g, int64_t V) {
  return V % 4 == 0 && reinterpret_cast<uintptr_t>(z) % 16 == 0 && reinterpret_cast<uintptr_t>(g) % 8 == 0;
}

// A block per row up to 2^20 blocks (the loop covers the rest), 256 threads: a 32,000-word row is
// 8,000 vectors, 31 per thread.
constexpr int kThreads = 256;
int blocks_for(int64_t rows) { return static_cast<int>(rows < (1 << 20) ? rows : (1 << 20)); }

}  // namespace

cudaError_t launch_softmax_grad_bf16(const void* z, const void* lse, const void* targets, int64_t vocab_start, void* g,
                                     int64_t rows, int64_t V, cudaStream_t stream) {
  if (rows == 0 || V == 0) return cudaSuccess;
  softmax_grad_bf16<<<blocks_for(rows), kThreads, 0, stream>>>(
      static_cast<const float*>(z), static_cast<const float*>(lse), static_cast<const int64_t*>(targets), vocab_start,
      static_cast<__nv_bfloat16*>(g), rows, V, vectors_apply(z, g, V));
  return cudaGetLastError();
}

void softmax_grad_bf16_on_host(const void* z, const void* lse, const void* targets, int64_t vocab_start, void* g,
                               int64_t rows, int64_t V, int64_t blocks, int threads) {
  if (rows == 0 || V == 0) return;
  if (blocks == 0) blocks = blocks_for(rows);
  if (threads == 0) threads = kThreads;
  const bool vectors = vectors_apply(z, g, V);
  for (int64_t b = 0; b < blocks; ++b)
    for (int t = 0; t < threads; ++t)
      softmax_grad_thread(static_cast<const float*>(z), static_cast<const float*>(lse),
                          static_cast<const int64_t*>(targets), vocab_start, static_cast<__nv_bfloat16*>(g), rows, V,
                          vectors, b, blocks, t, threads);
}

}  // namespace zb
