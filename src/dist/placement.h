#pragma once
// Where the ranks run, and so how their collectives can travel (runtime.backend). NCCL takes one
// rank per GPU; ranks that share a GPU (a multi-GPU layout debugged on one workstation GPU, the
// lent single-GPU machines) talk through Gloo, their tensors staged through host memory
// (dist/comm.h's GlooThroughHost). A GPU is known by its PCI address on its host, so that
// launchers that show each rank one GPU (all of them cuda:0) are not taken for sharing.
#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "dist/rendezvous.h"

namespace zb {

struct RankPlace {
  std::string host;
  std::string device;  // "cpu", or the GPU's PCI address
};

struct Placement {
  std::vector<RankPlace> ranks;  // in rank order
  int64_t rank = 0;              // this one's
  // How many ranks run on the device of rank `r` (on the CPU: 1; ranks share cores, not a device).
  int64_t sharing(int64_t r) const;
  int64_t sharing_mine() const { return sharing(rank); }
  // The most ranks on any one GPU of the job (1 where each has its own, or on the CPU).
  int64_t most_sharing() const;
};

// Every rank's host and device, through the store (all ranks call it at the same point).
Placement exchange_placement(const Rendezvous& rendezvous, const c10::Device& device);

struct BackendChoice {
  Transport transport = Transport::Gloo;
  std::string why;  // for the start-up line
};
// runtime.backend ("auto", "nccl", "gloo") for ranks placed as `placement` on `device` (every
// rank decides alike, from the same placement). auto: NCCL where every rank has its own GPU, else
// Gloo through host memory; Gloo on the CPU. Throws std::invalid_argument for NCCL on the CPU or
// on a shared GPU, naming where.
BackendChoice choose_backend(const std::string& requested, const c10::Device& device, const Placement& placement);

}  // namespace zb
