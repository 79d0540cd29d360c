// Collectives over Gloo between real processes on loopback (the launcher environment:
// tests/test_world.cpp).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <map>
#include <memory>
#include <thread>
#include <tuple>
#include <numeric>
#include <utility>

#include "dist/comm.h"
#include "dist/row_moves.h"
#include "parallel/row_shard.h"
#include "dist/world.h"
#include "multiprocess.h"

using namespace zb;

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllGatherReduceScatterAllReduceOverGloo) {
  const int W = GetParam();
  multiprocess::run_ranks(W, [W](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    ASSERT_EQ(comm.rank(), rank);
    // all_gather: rank r contributes [r*10 .. r*10+4]
    at::Tensor in = at::arange(5, at::kFloat) + 10.0 * rank;
    at::Tensor out = at::empty({5 * W}, at::kFloat);
    comm.all_gather(out, in).wait();
    for (int r = 0; r < W; ++r)
      EXPECT_TRUE(at::equal(out.slice(0, 5 * r, 5 * r + 5), at::arange(5, at::kFloat) + 10.0 * r));
    // reduce_scatter: every rank sends [0 .. 3W); rank r gets W * [3r .. 3r+2]
    at::Tensor big = at::arange(3 * W, at::kFloat);
    at::Tensor mine = at::empty({3}, at::kFloat);
    comm.reduce_scatter_sum(mine, big).wait();
    EXPECT_TRUE(at::equal(mine, W * at::arange(3 * rank, 3 * rank + 3, at::kFloat)));
    // all_reduce
    at::Tensor x = at::full({4}, static_cast<double>(rank + 1), at::kDouble);
    comm.all_reduce_sum(x).wait();
    EXPECT_DOUBLE_EQ(x[0].item<double>(), W * (W + 1) / 2.0);
    // broadcast from the last rank
    at::Tensor b = at::full({2}, static_cast<float>(rank), at::kFloat);
    comm.broadcast(b, W - 1).wait();
    EXPECT_EQ(b[1].item<float>(), static_cast<float>(W - 1));
    comm.barrier();
    EXPECT_EQ(comm.stats().bytes[static_cast<size_t>(CommKind::AllGather)], 5 * 4 * (W - 1) * 2);
  });
}


// The bytes each collective counts (comm_bytes.h: sent + received by this rank, ring / chain
// algorithms), checked against the algorithms written out step by step here.
namespace {

int64_t counted(Communicator& comm, CommKind kind) {
  return comm.stats().bytes[static_cast<size_t>(kind)];
}

// A ring all-reduce of `elements` elements split into W chunks as evenly as possible (the first
// elements % W chunks one larger): in reduce-scatter step k rank r sends chunk (r-k) mod W and
// receives chunk (r-k-1) mod W; then it holds chunk (r+1) mod W reduced, and in all-gather step k
// sends chunk (r+1-k) mod W and receives chunk (r-k) mod W. Returns what rank r sends + receives,
// in elements.
int64_t ring_all_reduce_elements(int64_t elements, int64_t W, int64_t r) {
  auto chunk = [&](int64_t c) {
    c = ((c % W) + W) % W;
    return elements / W + (c < elements % W ? 1 : 0);
  };
  int64_t moved = 0;
  for (int64_t k = 0; k < W - 1; ++k) moved += chunk(r - k) + chunk(r - k - 1);          // reduce-scatter
  for (int64_t k = 0; k < W - 1; ++k) moved += chunk(r + 1 - k) + chunk(r - k);      // all-gather
  return moved;
}

}  // namespace

TEST(CommBytes, RingAllReduceModelAddsUp) {
  // The model's sum over ranks is 4(W-1) x elements however the chunks fall, which is why comm_bytes.h
  // can count each rank the mean.
  for (int64_t W : {2, 3, 4, 5, 8})
    for (int64_t e : {0, 1, 2, 3, 5, 7, 12, 1000, 1001}) {
      int64_t sum = 0;
      for (int64_t r = 0; r < W; ++r) sum += ring_all_reduce_elements(e, W, r);
      EXPECT_EQ(sum, 4 * (W - 1) * e) << "W " << W << " elements " << e;
    }
}

TEST(CommBytes, OneProcessMovesNothing) {
  Communicator comm(detect_world(std::map<std::string, std::string>{}), c10::Device(c10::kCPU),
                    std::chrono::seconds(5));
  at::Tensor in = at::arange(6, at::kFloat), out = at::empty({6}, at::kFloat);
  comm.all_gather(out, in).wait();
  comm.reduce_scatter_sum(out, in).wait();
  comm.all_reduce_sum(in).wait();
  comm.broadcast(in, 0).wait();
  comm.all_to_all(out, in, {6}, {6}).wait();
  for (int64_t b : comm.stats().bytes) EXPECT_EQ(b, 0);
}

TEST_P(Collectives, CountsTheBytesEachRankMoves) {
  const int W = GetParam();
  multiprocess::run_ranks(W, [W](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    // Runs one collective and returns the bytes it added to `kind` (and to no other kind).
    auto delta = [&](CommKind kind, const std::function<void()>& collective) {
      const CommStats before = comm.stats();
      collective();
      for (size_t k = 0; k < before.bytes.size(); ++k)
        if (k != static_cast<size_t>(kind))
          EXPECT_EQ(comm.stats().bytes[k], before.bytes[k]) << comm_kind_name(static_cast<CommKind>(k));
      return counted(comm, kind) - before.bytes[static_cast<size_t>(kind)];
    };

    // all_gather of 7 floats per rank (28 bytes): a ring of W-1 steps, each sending one rank's
    // block on and receiving the next.
    {
      at::Tensor in = at::full({7}, static_cast<float>(rank), at::kFloat);
      at::Tensor out = at::empty({7 * W}, at::kFloat);
      const int64_t sent = (W - 1) * 28, received = (W - 1) * 28;
      EXPECT_EQ(delta(CommKind::AllGather, [&] { comm.all_gather(out, in).wait(); }), sent + received);
      EXPECT_EQ(out[7 * (W - 1)].item<float>(), static_cast<float>(W - 1));
    }
    // reduce_scatter to 5 doubles per rank (40 bytes out, 40·W in): W-1 steps of one 40-byte
    // partial sum each way.
    {
      at::Tensor in = at::ones({5 * W}, at::kDouble);
      at::Tensor out = at::empty({5}, at::kDouble);
      const int64_t sent = (W - 1) * 40, received = (W - 1) * 40;
      EXPECT_EQ(delta(CommKind::ReduceScatter, [&] { comm.reduce_scatter_sum(out, in).wait(); }),
                sent + received);
      EXPECT_DOUBLE_EQ(out[4].item<double>(), W);
    }
    // all_reduce, W dividing the elements (12·W floats): exactly 4(W-1)/W of the 48·W bytes, the
    // same on every rank.
    {
      at::Tensor t = at::ones({12 * W}, at::kFloat);
      const int64_t n = 48 * W;
      EXPECT_EQ(ring_all_reduce_elements(12 * W, W, rank) * 4, 4 * (W - 1) * n / W);
      EXPECT_EQ(delta(CommKind::AllReduce, [&] { comm.all_reduce_sum(t).wait(); }), 4 * (W - 1) * 48);
      EXPECT_EQ(t[0].item<float>(), static_cast<float>(W));
    }
    // all_reduce, W not dividing the elements (13 doubles, and one float): the mean over ranks of
    // the ring with the real, uneven chunks, rounded down to a byte.
    for (auto [elements, size] : {std::pair<int64_t, int64_t>{13, 8}, {1, 4}}) {
      at::Tensor t = at::ones({elements}, size == 8 ? at::kDouble : at::kFloat);
      int64_t all_ranks = 0;
      for (int64_t r = 0; r < W; ++r) all_ranks += ring_all_reduce_elements(elements, W, r) * size;
      EXPECT_EQ(delta(CommKind::AllReduce, [&] { comm.all_reduce_sum(t).wait(); }), all_ranks / W)
          << elements << " elements of " << size << " bytes";
    }
    // broadcast of 3 floats (12 bytes) from every root in turn: along the chain root, root+1, ...,
    // root-1 every rank but the last sends 12 bytes on and every rank but the root receives 12.
    for (int root = 0; root < W; ++root) {
      at::Tensor t = at::full({3}, static_cast<float>(rank == root ? 100 + root : -1), at::kFloat);
      const int position = (rank - root + W) % W;  // in the chain
      const int64_t sent = position < W - 1 ? 12 : 0, received = position > 0 ? 12 : 0;
      EXPECT_EQ(delta(CommKind::Broadcast, [&] { comm.broadcast(t, root).wait(); }), sent + received)
          << "root " << root << (rank == root ? " (this rank)" : "");
      EXPECT_EQ(t[2].item<float>(), static_cast<float>(100 + root));
    }
    // all_to_all with uneven splits, some empty: rank s sends rank d count(s, d) floats holding
    // 1000·s + d. What stays on this rank (count(rank, rank)) moves nowhere.
    {
      auto count = [](int s, int d) -> int64_t { return (s + 2 * d) % 4; };
      std::vector<int64_t> in_splits, out_splits;
      std::vector<at::Tensor> parts;
      for (int d = 0; d < W; ++d) {
        in_splits.push_back(count(rank, d));
        out_splits.push_back(count(d, rank));
        parts.push_back(at::full({count(rank, d)}, 1000.0 * rank + d, at::kFloat));
      }
      at::Tensor in = at::cat(parts);
      at::Tensor out = at::empty({std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0})}, at::kFloat);
      int64_t sent = 0, received = 0;
      for (int other = 0; other < W; ++other)
        if (other != rank) {
          sent += count(rank, other) * 4;
          received += count(other, rank) * 4;
        }
      EXPECT_EQ(delta(CommKind::AllToAll, [&] { comm.all_to_all(out, in, out_splits, in_splits).wait(); }),
                sent + received);
      int64_t at_offset = 0;
      for (int s = 0; s < W; ++s) {
        for (int64_t j = 0; j < count(s, rank); ++j)
          EXPECT_EQ(out[at_offset + j].item<float>(), static_cast<float>(1000 * s + rank));
        at_offset += count(s, rank);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Values(2, 3, 4));

// Through host memory (Transport::GlooThroughHost, what ranks sharing a GPU take) every collective
// gives what Gloo gives directly: both against the results written out here, in fp32 and bf16
// (small integers: exact in both, whatever the order of summation), a subgroup included.
class Transports : public ::testing::TestWithParam<Transport> {};

TEST_P(Transports, EveryCollectiveGivesTheResultWrittenOut) {
  const int W = 3;
  const Transport transport = GetParam();
  multiprocess::run_ranks(W, [W, transport](int rank) {
    {
      Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60), transport);
      ASSERT_EQ(comm.transport(), transport);
      for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        SCOPED_TRACE(std::string(transport_name(transport)) + ", " + c10::toString(dtype));
        const auto input_of = [dtype](int r, int64_t n) {  // rank r's input, which every rank can make
          at::manual_seed(100 + r);
          return at::randint(-8, 8, {n}).to(dtype);
        };
        at::Tensor gathered = at::empty({5 * W}, dtype);
        comm.all_gather(gathered, input_of(rank, 5)).wait();
        std::vector<at::Tensor> all;
        for (int r = 0; r < W; ++r) all.push_back(input_of(r, 5));
        EXPECT_TRUE(at::equal(gathered, at::cat(all)));

        at::Tensor mine = at::empty({3}, dtype), sum = at::zeros({3 * W}, dtype);
        comm.reduce_scatter_sum(mine, input_of(rank, 3 * W)).wait();
        for (int r = 0; r < W; ++r) sum += input_of(r, 3 * W);
        EXPECT_TRUE(at::equal(mine, sum.slice(0, 3 * rank, 3 * rank + 3)));

        at::Tensor x = input_of(rank, 4);
        comm.all_reduce_sum(x).wait();
        at::Tensor total = at::zeros({4}, dtype);
        for (int r = 0; r < W; ++r) total += input_of(r, 4);
        EXPECT_TRUE(at::equal(x, total));

        at::Tensor b = input_of(rank, 6);
        comm.broadcast(b, 1).wait();
        EXPECT_TRUE(at::equal(b, input_of(1, 6)));

        // Uneven: rank s sends d + 1 elements to rank d, so rank d receives d + 1 from each.
        std::vector<int64_t> in_splits, out_splits(W, rank + 1);
        for (int d = 0; d < W; ++d) in_splits.push_back(d + 1);
        const int64_t sent = W * (W + 1) / 2, offset = rank * (rank + 1) / 2;
        at::Tensor received = at::empty({W * (rank + 1)}, dtype);
        comm.all_to_all(received, input_of(rank, sent), out_splits, in_splits).wait();
        std::vector<at::Tensor> pieces;
        for (int s = 0; s < W; ++s) pieces.push_back(input_of(s, sent).slice(0, offset, offset + rank + 1));
        EXPECT_TRUE(at::equal(received, at::cat(pieces)));

        // A subgroup travels as its parent does.
        if (rank != 1) {
          std::unique_ptr<Communicator> pair = comm.subgroup(std::string("pair.") + c10::toString(dtype), {2, 0});
          EXPECT_EQ(pair->transport(), transport);
          at::Tensor y = input_of(rank, 2);
          pair->all_reduce_sum(y).wait();
          EXPECT_TRUE(at::equal(y, input_of(0, 2) + input_of(2, 2)));
        }
      }
      comm.barrier();
    }
  });
}
INSTANTIATE_TEST_SUITE_P(Gloo, Transports, ::testing::Values(Transport::Gloo, Transport::GlooThroughHost),
                         [](const ::testing::TestParamInfo<Transport>& p) {
                           return p.param == Transport::Gloo ? std::string("Direct") : std::string("ThroughHost");
                         });

TEST(Barrier, BlocksTheHostUntilEveryRankArrives) {
  // Through the store, so the host waits on any backend (an NCCL all-reduce's wait would only
  // order the GPU's stream). The last rank arrives 1.5 s late: every other rank must still be
  // inside barrier() until then, in the world and in a subgroup alike.
  multiprocess::run_ranks(4, [](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    std::unique_ptr<Communicator> pair = comm.subgroup("pair" + std::to_string(rank / 2), {rank / 2 * 2, rank / 2 * 2 + 1});
    for (Communicator* group : {&comm, pair.get()}) {
      const bool late = group->rank() == group->size() - 1;
      const auto start = std::chrono::steady_clock::now();
      if (late) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      group->barrier();
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_GE(waited, 1.4) << "rank " << rank << " left barrier() before the last rank arrived";
    }
  });
}

TEST(Watchdog, AbortsEveryGroupsBackend) {
  // On a stall the watchdog aborts the world's backend and every live subgroup's (hybrid
  // sharding's shard and replicate groups), so that no rank stays blocked in a group's collective.
  multiprocess::run_ranks(4, [](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    EXPECT_EQ(comm.backends_to_abort(), 1u);
    {
      auto shard = comm.subgroup("shard" + std::to_string(rank / 2), {rank / 2 * 2, rank / 2 * 2 + 1});
      auto replicate = comm.subgroup("replicate" + std::to_string(rank % 2), {rank % 2, rank % 2 + 2});
      EXPECT_EQ(comm.backends_to_abort(), 3u);
      at::Tensor x = at::ones({3});
      replicate->all_reduce_sum(x).wait();
      EXPECT_EQ(x[0].item<float>(), 2.0f);
    }
    EXPECT_EQ(comm.backends_to_abort(), 1u);  // a group gone is no longer aborted
  });
}

TEST(Comm, AWriteToADeadPeerIsAnErrorNotTheEndOfTheProcess) {
  // Gloo sends with writev: to a peer that has died, that raises SIGPIPE, whose default ends the
  // process without a word (a killed rank took its peer with it, silently, now and then). Once a
  // communicator exists, such a write fails with EPIPE and the rank lives to report it.
  multiprocess::run_ranks(2, [](int) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    int ends[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, ends), 0);
    ::close(ends[1]);  // the peer is gone
    const char byte = 1;
    errno = 0;
    EXPECT_EQ(::write(ends[0], &byte, 1), -1);
    EXPECT_EQ(errno, EPIPE);
    ::close(ends[0]);
  });
}

// Rows between layouts (dist/row_moves.h), as elastic DiLoCo's mixed generations move them: 5 ranks,
// a replica sharded over 2 of them (ranks 0-1) and one over 3 (ranks 2-4), two tensors of 7 and 2
// rows. Each rank sends every owner of 1/5 of the rows its own rows there, and every owner receives
// each of its rows once from each replica, with that replica's values; then the owners' rows go back
// into the 3-rank replica's layout, each row from its one owner.
TEST(RowMoves, RowsReachTheirOwnersOnceFromEachReplica) {
  multiprocess::run_ranks(5, [](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    const int64_t replica = rank < 2 ? 0 : 1, shards = rank < 2 ? 2 : 3, shard_rank = rank < 2 ? rank : rank - 2;
    const std::vector<std::vector<int64_t>> shapes = {{7, 3}, {2}};
    // The value of tensor t's element (row, col) in `replica`: all distinct.
    const auto value = [](int64_t t, int64_t replica, int64_t row, int64_t col) {
      return static_cast<float>(1000 * t + 100 * replica + 10 * row + col);
    };
    std::vector<RowSpan> held, owned;
    std::vector<int64_t> row_numel;
    std::vector<at::Tensor> local;
    for (size_t t = 0; t < shapes.size(); ++t) {
      const RowShard mine = RowShard::of(shapes[t], shards), owners = RowShard::of(shapes[t], 5);
      held.push_back({mine.first_row(shard_rank), mine.rows_of(shard_rank)});
      owned.push_back({owners.first_row(rank), owners.rows_of(rank)});
      row_numel.push_back(mine.row_numel);
      at::Tensor rows = at::empty({held.back().rows, mine.row_numel}, at::kFloat);
      for (int64_t r = 0; r < held.back().rows; ++r)
        for (int64_t c = 0; c < mine.row_numel; ++c)
          rows[r][c] = value(static_cast<int64_t>(t), replica, held.back().first + r, c);
      local.push_back(rows);
    }
    const RowMoves there = RowMoves::plan(comm, held, owned, row_numel);
    const at::Tensor got = there.exchange(comm, local, at::TensorOptions().dtype(at::kFloat));
    // How often each (tensor, replica, row) arrived, and with the right values.
    std::map<std::tuple<size_t, int64_t, int64_t>, int> seen;
    for (int64_t k = 0; k < 5; ++k) {
      const std::vector<at::Tensor> pieces = there.unpack(k, there.part(k, got));
      ASSERT_EQ(pieces.size(), there.receives(k).size());
      for (size_t i = 0; i < pieces.size(); ++i) {
        const RowMoves::Run& run = there.receives(k)[i];
        for (int64_t r = 0; r < run.rows.rows; ++r)
          for (int64_t c = 0; c < row_numel[run.tensor]; ++c)
            ASSERT_EQ(pieces[i][r][c].item<float>(),
                      value(static_cast<int64_t>(run.tensor), k < 2 ? 0 : 1, run.rows.first + r, c));
        for (int64_t r = 0; r < run.rows.rows; ++r) ++seen[{run.tensor, k < 2 ? 0 : 1, run.rows.first + r}];
      }
    }
    size_t expected = 0;
    for (size_t t = 0; t < shapes.size(); ++t) {
      expected += 2 * static_cast<size_t>(owned[t].rows);
      for (int64_t r = owned[t].first; r < owned[t].end(); ++r)
        for (int64_t rep = 0; rep < 2; ++rep) EXPECT_EQ((seen[{t, rep, r}]), 1) << "tensor " << t << " row " << r;
    }
    EXPECT_EQ(seen.size(), expected);
    // Back: the owners' rows (the 3-rank replica's values) into the 3-rank layout on every rank.
    std::vector<at::Tensor> owner_rows;
    std::vector<RowSpan> wanted;
    for (size_t t = 0; t < shapes.size(); ++t) {
      at::Tensor rows = at::empty({owned[t].rows, row_numel[t]}, at::kFloat);
      for (int64_t r = 0; r < owned[t].rows; ++r)
        for (int64_t c = 0; c < row_numel[t]; ++c) rows[r][c] = value(static_cast<int64_t>(t), 1, owned[t].first + r, c);
      owner_rows.push_back(rows);
      const RowShard three = RowShard::of(shapes[t], 3);
      wanted.push_back({three.first_row(rank % 3), three.rows_of(rank % 3)});
    }
    const RowMoves back = RowMoves::plan(comm, owned, wanted, row_numel);
    const at::Tensor returned = back.exchange(comm, owner_rows, at::TensorOptions().dtype(at::kFloat));
    int64_t rows_back = 0;
    for (int64_t k = 0; k < 5; ++k) {
      const std::vector<at::Tensor> pieces = back.unpack(k, back.part(k, returned));
      for (size_t i = 0; i < pieces.size(); ++i) {
        const RowMoves::Run& run = back.receives(k)[i];
        rows_back += run.rows.rows;
        for (int64_t r = 0; r < run.rows.rows; ++r)
          for (int64_t c = 0; c < row_numel[run.tensor]; ++c)
            ASSERT_EQ(pieces[i][r][c].item<float>(), value(static_cast<int64_t>(run.tensor), 1, run.rows.first + r, c));
      }
    }
    EXPECT_EQ(rows_back, wanted[0].rows + wanted[1].rows);
    // take() puts the same rows in place: each rank's wanted rows, whole.
    std::vector<at::Tensor> placed;
    for (size_t t = 0; t < shapes.size(); ++t) placed.push_back(at::full({wanted[t].rows, row_numel[t]}, -1.0f));
    back.take(returned, placed);
    for (size_t t = 0; t < shapes.size(); ++t)
      for (int64_t r = 0; r < wanted[t].rows; ++r)
        for (int64_t c = 0; c < row_numel[t]; ++c)
          ASSERT_EQ(placed[t][r][c].item<float>(), value(static_cast<int64_t>(t), 1, wanted[t].first + r, c));
  });
}
