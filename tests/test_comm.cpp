// Collectives over Gloo between real processes on loopback, and the launcher environment.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dist/comm.h"
#include "dist/world.h"
#include "multiprocess.h"

using namespace zb;

TEST(World, FromEachLauncher) {
  World t = detect_world({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                          {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(t.launcher, "torchrun");
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.size, 8);
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.master_addr, "node0");
  EXPECT_EQ(t.master_port, 1234);
  World o = detect_world({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(o.launcher, "OpenMPI");
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  World p = detect_world({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}});
  EXPECT_EQ(p.launcher, "MPICH/PMI");
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.size, 4);
  World s = detect_world({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                          {"SLURM_NTASKS_PER_NODE", "8"}});
  EXPECT_EQ(s.launcher, "SLURM");
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.local_size, 8);
  World none = detect_world(std::map<std::string, std::string>{});
  EXPECT_FALSE(none.distributed());
}

TEST(World, BadValuesAreNamed) {
  auto msg = [](std::map<std::string, std::string> env) {
    try {
      detect_world(env);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(msg({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "rank 2 is outside [0, 2) (from torchrun)");
  EXPECT_EQ(msg({{"RANK", "0"}, {"WORLD_SIZE", "two"}}), "WORLD_SIZE='two' is not an integer");
  EXPECT_EQ(msg({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "world size 0 must be >= 1 (from torchrun)");
  EXPECT_EQ(msg({{"MASTER_PORT", "70000"}}), "MASTER_PORT=70000 is not a TCP port");
}

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

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Values(2, 3, 4));
