// Context parallelism (model_parallel/context_parallel.h): the split of a row and, on real processes over
// Gloo in float64, a rank's attention over the gathered keys against attention over the whole row
// (forward and every input's gradient), with documents shorter than a chunk and crossing chunks.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "dist/comm.h"
#include "model/attention.h"
#include "model_parallel/context_parallel.h"
#include "model_parallel/tensor_parallel.h"
#include "multiprocess.h"
#include "parallel/mesh.h"
#include "parallel/model_parallel_group.h"

using namespace zb;

TEST(ContextParallel, EachRankHoldsChunksIAndMirrorCoveringTheRowOnce) {
  // 16 tokens over 2 ranks: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_TRUE(at::equal(cp_positions(0, 2, 16), at::tensor({0, 1, 2, 3, 12, 13, 14, 15}, at::kLong)));
  EXPECT_TRUE(at::equal(cp_positions(1, 2, 16), at::tensor({4, 5, 6, 7, 8, 9, 10, 11}, at::kLong)));
  for (const int64_t n : {1, 2, 4}) {
    const at::Tensor all = cp_gathered_positions(n, 32);
    EXPECT_TRUE(at::equal(std::get<0>(all.sort()), at::arange(32, at::kLong))) << n;
    // Causal work: a query at position p sees p + 1 keys; every rank's total is the same.
    std::vector<int64_t> work;
    for (int64_t r = 0; r < n; ++r) work.push_back((cp_positions(r, n, 32) + 1).sum().item<int64_t>());
    for (int64_t w : work) EXPECT_EQ(w, work[0]) << n;
  }
  EXPECT_THROW(cp_positions(0, 3, 16), c10::Error);  // 16 does not divide into 6 chunks
}

TEST(ContextParallel, MeshPlacesCpInsideTheShardGroup) {
  // 8 ranks: 2 replicas x dp_shard 2 x cp 2 (x tp 1): FSDP shards over dp_shard x cp = 4.
  Config c;
  c.parallel.dp_replicate = 2;
  c.parallel.cp = 2;
  const MeshShape m = mesh_shape(c, 8);
  EXPECT_EQ(m.dp_shard_cp, 4);
  EXPECT_EQ(m.data_parallel_size(), 4);
  EXPECT_EQ(m.cp_group_ranks(5), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(m.shard_group_ranks(5), (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_EQ(m.replicate_group_ranks(5), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(m.cp_rank_of(5), 1);
  EXPECT_EQ(m.data_parallel_rank_of(5), 2);  // ranks 4 and 5 read the same rows
  EXPECT_EQ(m.data_parallel_rank_of(4), 2);
}

// q, k, v of whole rows; each rank attends with its positions' queries to the keys and values
// gathered from the group, or passed around it (ring_attention), under cp_documents' mask; out
// and the gradients of q, k and v (through the gather's backward, the reduce-scatter, or the
// ring's own backward) must be the whole row's at this rank's positions.
TEST(ContextParallel, AttentionOverTheGroupEqualsTheWholeRowInFloat64) {
  for (const int W : {2, 4}) {
    multiprocess::run_ranks(W, [W](int rank) {
      Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
      CommModelParallelGroup group(comm);
      const int64_t B = 2, T = 32, H = 4, Hkv = 2, Dh = 8;
      at::manual_seed(7);  // the same whole rows on every rank
      const auto opts = at::TensorOptions().dtype(at::kDouble);
      const at::Tensor q = at::randn({B, T, H, Dh}, opts), k = at::randn({B, T, Hkv, Dh}, opts),
                       v = at::randn({B, T, Hkv, Dh}, opts), dout = at::randn({B, T, H * Dh}, opts);
      // Documents of 3, 9, 2, 18 tokens in row 0 and 20, 12 in row 1 (every row's start a boundary).
      const at::Tensor cu = at::tensor({0, 3, 12, 14, 32, 52, 64}, at::kInt);
      // The whole row's attention, through make_documents' mask (the CPU path).
      const Documents whole = make_documents(cu, 20, T, c10::kCPU, at::kDouble, /*flash=*/false);
      const at::Tensor qw = q.clone().requires_grad_(), kw = k.clone().requires_grad_(), vw = v.clone().requires_grad_();
      const at::Tensor out_whole = attention(qw, kw, vw, whole);
      (out_whole * dout).sum().backward();
      // This rank's share.
      const at::Tensor mine = cp_positions(rank, W, T);
      const Documents docs = cp_documents(cu, B, T, rank, W, c10::kCPU, at::kDouble, /*ring=*/true);
      auto close = [](const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); };
      for (const bool ring : {false, true}) {
        SCOPED_TRACE(ring ? "ring" : "allgather");
        const at::Tensor ql = q.index_select(1, mine).requires_grad_(), kl = k.index_select(1, mine).requires_grad_(),
                         vl = v.index_select(1, mine).requires_grad_();
        const at::Tensor out = ring ? ring_attention(ql, kl, vl, docs, group)
                                    : attention(ql, gather_sequence(kl, group), gather_sequence(vl, group), docs);
        (out * dout.index_select(1, mine)).sum().backward();
        EXPECT_LT(close(out, out_whole.index_select(1, mine)), 1e-12);
        EXPECT_LT(close(ql.grad(), qw.grad().index_select(1, mine)), 1e-12);
        EXPECT_LT(close(kl.grad(), kw.grad().index_select(1, mine)), 1e-12);
        EXPECT_LT(close(vl.grad(), vw.grad().index_select(1, mine)), 1e-12);
      }
    });
  }
}
