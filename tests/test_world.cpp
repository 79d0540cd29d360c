// The launcher environment: rank, world and rendezvous from torchrun, OpenMPI, MPICH/PMI and
// SLURM variables, and the errors that name a bad value.
#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <string>

#include "dist/world.h"

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
  // An srun step: its tasks, and this node's share of them (SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID).
  World s = detect_world({{"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "16"}, {"SLURM_LOCALID", "1"},
                          {"SLURM_STEP_TASKS_PER_NODE", "8(x2)"}, {"SLURM_NODEID", "0"}, {"SLURM_NTASKS", "16"}});
  EXPECT_EQ(s.launcher, "SLURM");
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.size, 16);
  EXPECT_EQ(s.local_size, 8);
  World uneven = detect_world({{"SLURM_PROCID", "6"}, {"SLURM_STEP_NUM_TASKS", "7"}, {"SLURM_LOCALID", "0"},
                               {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_NODEID", "3"}});
  EXPECT_EQ(uneven.local_size, 1);
  EXPECT_EQ(detect_world({{"SLURM_PROCID", "2"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_LOCALID", "0"},
                          {"SLURM_STEP_TASKS_PER_NODE", "1,3"}, {"SLURM_NODEID", "1"}}).local_size, 3);
  // A batch script's own process (SLURM_PROCID and SLURM_NTASKS, no step): one process.
  EXPECT_FALSE(detect_world({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}}).distributed());
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
  const std::string torchrun = " (from torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)";
  EXPECT_EQ(msg({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "rank 2 is outside [0, 2)" + torchrun);
  EXPECT_EQ(msg({{"RANK", "0"}, {"WORLD_SIZE", "two"}}), "WORLD_SIZE='two' is not an integer");
  EXPECT_EQ(msg({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "world size 0 must be >= 1" + torchrun);
  EXPECT_EQ(msg({{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}}),
            "WORLD_SIZE='99999999999999999999' is not an integer");
  EXPECT_EQ(msg({{"RANK", " 1"}, {"WORLD_SIZE", "2"}}), "RANK=' 1' is not an integer");
  EXPECT_EQ(msg({{"RANK", "0"}, {"WORLD_SIZE", "+2"}}), "WORLD_SIZE='+2' is not an integer");
  EXPECT_EQ(msg({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
            "local rank 3 is outside [0, 2) (from OpenMPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, "
            "OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE)");
  EXPECT_EQ(msg({{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "2(y3)"},
                 {"SLURM_NODEID", "0"}}),
            "SLURM_STEP_TASKS_PER_NODE='2(y3)' is not a list like 2(x3),1");
  EXPECT_EQ(msg({{"MASTER_PORT", "70000"}}), "MASTER_PORT=70000 is not a TCP port");
}
