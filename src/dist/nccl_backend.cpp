// NCCL for CUDA tensors, in the GPU plugin (util/cuda_plugin.h). The only translation unit that
// includes ProcessGroupNCCL.hpp (it pulls in CUDA and nccl.h). nccl.h comes from the NCCL that
// torch links (the nvidia-nccl wheel next to torch; src/CMakeLists.txt), and the version it
// declares must be the one running: structures such as ncclConfig_t change between releases, and
// a mismatch corrupts memory without an error.
#include <c10/cuda/CUDAFunctions.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <stdexcept>
#include <string>
#include <tuple>

#include "dist/comm.h"

namespace zb::gpu {

void check_nccl_version() {
  const auto [major, minor, patch] = c10d::getNcclVersionTuple();  // the library loaded now
  if (std::make_tuple(major, minor, patch) != std::make_tuple(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH))
    throw std::runtime_error(
        "NCCL: built against nccl.h " + std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
        std::to_string(NCCL_PATCH) + " but the library loaded at run time is " + std::to_string(major) + "." +
        std::to_string(minor) + "." + std::to_string(patch) +
        " (LD_LIBRARY_PATH or another NCCL installed?); rebuild against the NCCL that torch uses");
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world, const c10::Device& device,
                                                    std::chrono::milliseconds timeout) {
  check_nccl_version();
  // The device select_device chose for this rank (not local_rank: with one visible GPU per rank,
  // as SLURM's --gpus-per-task gives, every rank's GPU is cuda:0).
  c10::cuda::set_device(device.index());
  // High-priority streams for the collectives, as FSDP2's, so that the gathers the next block
  // waits for are not queued behind compute kernels.
  auto opts = c10d::ProcessGroupNCCL::Options::create(/*is_high_priority_stream=*/true);
  opts->timeout = timeout;
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(world.rank),
                                                             static_cast<int>(world.size), opts);
  // Bound to its device, the communicator is created now (every rank does this here), so that a
  // broken NCCL set-up fails at start rather than in the first step.
  backend->setBoundDeviceId(device);
  backend->eagerConnectSingleDevice(device);
  return backend;
}

c10::intrusive_ptr<c10d::Backend> split_nccl_backend(const c10::intrusive_ptr<c10d::Backend>& parent,
                                                     const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::vector<int64_t>& ranks,
                                                     std::chrono::milliseconds timeout) {
  // Options as the world's (high-priority streams, the same timeout); c10d's split fills in the
  // parent, the colour (from the ranks) and the global ranks, splits the parent's communicator
  // (a collective over all of the parent's ranks) and connects the new one at once.
  auto opts = c10d::ProcessGroupNCCL::Options::create(/*is_high_priority_stream=*/true);
  opts->timeout = timeout;
  const std::vector<int> members(ranks.begin(), ranks.end());
  c10::intrusive_ptr<c10d::Backend> backend = parent->split(store, members, opts);
  TORCH_CHECK(backend, "NCCL: splitting a subgroup from the world's communicator returned none");
  return backend;
}

}  // namespace zb::gpu

extern "C" const zb::NcclFunctions* zb_nccl_functions(std::size_t table_bytes) {
  if (table_bytes != sizeof(zb::NcclFunctions)) return nullptr;
  static const zb::NcclFunctions table{zb::gpu::make_nccl_backend, zb::gpu::split_nccl_backend};
  return &table;
}
