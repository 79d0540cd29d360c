#pragma once
// The bytes a collective counts: the one convention of the project's communication figures
// (the metrics' comm_bytes, the step plan, the scale model, the benchmark's PyTorch peer). No
// LibTorch here: tools in other languages load it as libzb_comm_bytes.so (C interface at the end;
// scripts/perf/comm_bytes.py).
#include <cstdint>
#include <vector>

namespace zb {

enum class CommKind { AllGather, ReduceScatter, AllReduce, Broadcast, AllToAll, Count };
const char* comm_kind_name(CommKind kind);

// Bytes are counted per rank as the bytes this rank SENDS plus the bytes it RECEIVES, for the
// bandwidth-optimal ring (chain) algorithm of each collective, whatever the backend really runs
// (Gloo and NCCL pick their own algorithms; this is a model, the same on every backend and the
// same for the PyTorch peer's collectives in scripts/perf/bench_peer.py, which calls these
// functions through the C interface below). W ranks; with W = 1 every count is 0.
//   all_gather      n = input bytes:  (W-1)·n sent + (W-1)·n received  = 2(W-1)·n
//   reduce_scatter  n = output bytes: (W-1)·n sent + (W-1)·n received  = 2(W-1)·n
//   all_reduce      N = tensor bytes: a ring reduce-scatter then all-gather of W chunks of N/W,
//                   each sending and receiving (W-1)·N/W             = 4(W-1)·N/W
//                   When W does not divide the element count the chunks are uneven and a rank's
//                   own share depends on which chunks it holds; we count the mean over ranks
//                   (exactly 4(W-1)·N/W, as the sum over ranks is 4(W-1)·N), rounded down to a
//                   whole byte: under 1 byte per call.
//   broadcast       N = tensor bytes, a pipelined chain root -> root+1 -> ... -> root-1 (mod W):
//                   the root sends N; the last rank of the chain, (root-1) mod W, receives N;
//                   every rank between receives N and forwards N, 2N. (Sum over ranks 2(W-1)·N.)
//   all_to_all      the elements this rank sends to the other ranks plus those it receives from
//                   them (its own split, kept locally, is not counted), times the element size.
// The count above for one call of a ring collective (all_gather, reduce_scatter, all_reduce) over
// `ranks` ranks, `payload` bytes as the convention names them: the one formula, which the
// Communicator counts with and the step plan (plan/step_plan.h) predicts with.
int64_t ring_counted_bytes(CommKind kind, int64_t ranks, int64_t payload);
// broadcast of `payload` bytes from `root`, as counted by `rank`.
int64_t broadcast_counted_bytes(int64_t ranks, int64_t rank, int64_t root, int64_t payload);
// gather / scatter (the peer's Muon uses them; our engines do not): the root receives (sends) the
// other ranks' `payload` bytes each, every other rank sends (receives) its own.
int64_t rooted_counted_bytes(int64_t ranks, int64_t rank, int64_t root, int64_t payload);
// all_to_all of `in_units` units of `unit_bytes` each into `out_units`: `in_splits[d]` units go to
// rank d, `out_splits[s]` come from rank s; empty splits mean equal parts (as c10d).
int64_t all_to_all_counted_bytes(int64_t ranks, int64_t rank, int64_t unit_bytes, int64_t in_units,
                                 int64_t out_units, const std::vector<int64_t>& in_splits,
                                 const std::vector<int64_t>& out_splits);

}  // namespace zb

extern "C" {
// By the collective's name ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "gather",
// "scatter"; `rank` and `root` matter for the rooted ones); -1 for an unknown name.
int64_t zb_counted_bytes(const char* kind, int64_t ranks, int64_t rank, int64_t root, int64_t payload);
// all_to_all_counted_bytes; null splits mean equal parts, else `ranks` entries each.
int64_t zb_all_to_all_counted_bytes(int64_t ranks, int64_t rank, int64_t unit_bytes, int64_t in_units,
                                    int64_t out_units, const int64_t* in_splits, const int64_t* out_splits);
}
