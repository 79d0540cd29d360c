#pragma once
// Who we are in the job: rank, world size and local rank, read from the launcher's environment.
//   torchrun:      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   OpenMPI:       OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
//   MPICH / PMI:   PMI_RANK, PMI_SIZE (MPI_LOCALRANKID, MPI_LOCALNRANKS)
//   SLURM (srun):  SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//   none of them:  a single process.
// The rendezvous address is MASTER_ADDR:MASTER_PORT whatever the launcher (default
// 127.0.0.1:29500).
#include <cstdint>
#include <map>
#include <string>

namespace zb {

struct World {
  int64_t rank = 0;
  int64_t size = 1;
  int64_t local_rank = 0;
  int64_t local_size = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  std::string launcher = "single process";
  bool distributed() const { return size > 1; }
};

// From the process environment. Throws std::invalid_argument naming the variable for values that
// are not numbers or are inconsistent (rank outside [0, size), size < 1, ...).
World detect_world();
// The same from an explicit environment (for tests).
World detect_world(const std::map<std::string, std::string>& env);
// This machine's host name (for reports of where each rank runs).
std::string host_name();

}  // namespace zb
