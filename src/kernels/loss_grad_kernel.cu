// The chunked loss's kernels (model/chunked_loss.cpp), each one pass over the fp32 logits z [n, V]:
// - each row's log-sum-exp: ATen's logsumexp takes four (the row maximum, z - max written out, exp
//   in place, the sum: 20 bytes of traffic per element, 18.6 ms of a 1B step on an H100) where this
//   reads 4 bytes, keeping a running maximum and the sum of exponentials relative to it;
// - the gradient of the logits, softmax(z) - onehot(target) rounded to bf16 for the two GEMMs that
//   follow. ATen's operators make it in three passes (z - lse in place, exp in place, the cast to
//   bf16: 22 bytes of traffic per element) where this reads 4 bytes and writes 2. The numbers are
//   theirs: expf(z - lse) in fp32, then -1 added at the target, then rounded to the nearest bf16,
//   even on ties.
// Plain CUDA: no LibTorch headers here.
#include "kernels/block_reduce_host.h"
#include "kernels/cuda_kernels.h"
#include "kernels/device_helpers.cuh"

#include <cuda_bf16.h>

#include <vector>

// In zb: the profiler counts kernels named zb:: as ours (observe/profiler.h, kernel_kind).
namespace zb {
namespace {
using namespace device;

// One row of z per block at a time: the row's log-sum-exp and target are read once. The column of
// the target here is target - vocab_start (under a vocabulary split over ranks, a word of another
// rank's falls outside [0, V) and gets no one-hot). Columns go four at a time (a 16-byte read, an
// 8-byte write) where V is a multiple of 4 and the pointers aligned, else one at a time. One
// thread's loops (`block` of `blocks`, `thread` of `threads` in it), host and device: the tests
// also run them on the CPU (softmax_grad_bf16_on_host).
ZB_HD void softmax_grad_thread(const float* __restrict__ z, const float* __restrict__ lse,
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
      reinterpret_cast<Bf16x4*>(gr + c)[0] = {{bf16(e0), bf16(e1), bf16(e2), bf16(e3)}};  // one 8-byte store
    }
    for (int64_t c = n_vectors * 4 + thread; c < V; c += threads) {
      float e = expf(zr[c] - m);
      if (c == target) e += -1.0f;
      gr[c] = bf16(e);
    }
  }
}

__global__ void softmax_grad_bf16(const float* __restrict__ z, const float* __restrict__ lse,
                                  const int64_t* __restrict__ targets, int64_t vocab_start,
                                  __nv_bfloat16* __restrict__ g, int64_t rows, int64_t V, bool vectors) {
  softmax_grad_thread(z, lse, targets, vocab_start, g, rows, V, vectors, blockIdx.x, gridDim.x, threadIdx.x,
                      blockDim.x);
}

// A running log-sum-exp: the largest value seen, m, and the sum of exp(value - m). Two of them
// combine by rescaling the smaller maximum's sum. Nothing seen yet is (-inf, 0). Special values
// end as ATen's logsumexp ends them: a NaN anywhere makes the row's result NaN (m = NaN, kept
// from then on), a +inf makes it +inf (m = +inf; s no longer matters).
struct RunningLse {
  float m, s;
};

ZB_HD bool is_nan(float x) { return x != x; }

ZB_HD RunningLse lse_combine(RunningLse a, RunningLse b) {
  if (is_nan(a.m) || is_nan(b.m)) return {NAN, NAN};
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY || m == INFINITY) return {m, 1.0f};  // the result is m itself
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// A new largest value (one value, or the largest of four: NaN if any is): the sum is rescaled only
// when a larger maximum arrives (rarely, after a row's first values), so one exp per value.
ZB_HD void lse_add(RunningLse& acc, float largest) {
  if (is_nan(largest) || is_nan(acc.m)) {
    acc = {NAN, NAN};
  } else if (largest > acc.m) {
    acc.s = acc.m == -INFINITY ? 0.0f : acc.s * expf(acc.m - largest);
    acc.m = largest;
  }
}

// One thread's share of row r: columns thread, thread + threads, ... (four at a time where vectors).
ZB_HD RunningLse lse_thread(const float* __restrict__ zr, int64_t V, bool vectors,
                                                          int thread, int threads) {
  RunningLse acc{-INFINITY, 0.0f};
  const int64_t n_vectors = vectors ? V / 4 : 0;
  for (int64_t j = thread; j < n_vectors; j += threads) {
    const float4 v = reinterpret_cast<const float4*>(zr)[j];
    const bool nan = is_nan(v.x) || is_nan(v.y) || is_nan(v.z) || is_nan(v.w);
    lse_add(acc, nan ? NAN : fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
    if (acc.m == -INFINITY || is_nan(acc.m)) continue;  // nothing to add (exp(-inf - -inf) is NaN)
    acc.s += expf(v.x - acc.m) + expf(v.y - acc.m) + expf(v.z - acc.m) + expf(v.w - acc.m);
  }
  for (int64_t c = n_vectors * 4 + thread; c < V; c += threads) {
    lse_add(acc, zr[c]);
    if (acc.m != -INFINITY && !is_nan(acc.m)) acc.s += expf(zr[c] - acc.m);
  }
  return acc;
}

ZB_HD float lse_value(RunningLse a) {
  if (is_nan(a.m) || a.m == -INFINITY || a.m == INFINITY) return a.m;
  return a.m + logf(a.s);
}

// One row per block at a time: each thread's share, then the block's 256 combined through the
// warps' shuffles and shared memory (8 warps), the result written by thread 0.
__global__ void row_logsumexp_fp32(const float* __restrict__ z, float* __restrict__ lse, int64_t rows, int64_t V,
                                   bool vectors) {
  __shared__ RunningLse warps[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = (blockDim.x + 31) / 32;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    RunningLse acc = lse_thread(z + r * V, V, vectors, threadIdx.x, blockDim.x);
    for (int offset = 16; offset > 0; offset /= 2)
      acc = lse_combine(acc, {__shfl_xor_sync(0xffffffffu, acc.m, offset), __shfl_xor_sync(0xffffffffu, acc.s, offset)});
    if (lane == 0) warps[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      acc = lane < n_warps ? warps[lane] : RunningLse{-INFINITY, 0.0f};
      for (int offset = 16; offset > 0; offset /= 2)
        acc = lse_combine(acc, {__shfl_xor_sync(0xffffffffu, acc.m, offset), __shfl_xor_sync(0xffffffffu, acc.s, offset)});
      if (lane == 0) lse[r] = lse_value(acc);
    }
    __syncthreads();  // warps[] is rewritten for the next row
  }
}

bool vectors_apply(const void* z, const void* g, int64_t V) {
  return V % 4 == 0 && aligned(z, 16) && aligned(g, 8);
}

// A block per row up to 2^20 blocks (the loop covers the rest), 256 threads: a 32,000-word row is
// 8,000 vectors, 31 per thread.
constexpr int kThreads = 256;  // a multiple of 32 (the log-sum-exp's warp shuffles)
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

cudaError_t launch_row_logsumexp_fp32(const void* z, void* lse, int64_t rows, int64_t V, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  row_logsumexp_fp32<<<blocks_for(rows), kThreads, 0, stream>>>(static_cast<const float*>(z), static_cast<float*>(lse),
                                                                rows, V, vectors_apply(z, z, V));
  return cudaGetLastError();
}

void row_logsumexp_fp32_on_host(const void* z, void* lse, int64_t rows, int64_t V, int threads) {
  if (threads == 0) threads = kThreads;
  const bool vectors = vectors_apply(z, z, V);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<RunningLse> parts(threads);
    for (int t = 0; t < threads; ++t) parts[t] = lse_thread(static_cast<const float*>(z) + r * V, V, vectors, t, threads);
    static_cast<float*>(lse)[r] = lse_value(combine_as_shuffles(parts, RunningLse{-INFINITY, 0.0f}, lse_combine));
  }
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
