#pragma once
// Collectives for the training engine, on PyTorch's c10d: a TCPStore rendezvous and one backend,
// Gloo for CPU tensors, NCCL for CUDA tensors. Every call counts the bytes it moves by kind, and
// waiting on results is timed, for the per-step metrics. With a world of one process nothing is
// created and every collective is a local copy.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <chrono>
#include <memory>
#include <string>

#include "dist/world.h"

namespace c10d {
class Backend;
class Store;
class Work;
}  // namespace c10d

namespace zb {

enum class CommKind { AllGather, ReduceScatter, AllReduce, Broadcast, AllToAll, Count };
const char* comm_kind_name(CommKind kind);

struct CommStats {
  std::array<int64_t, static_cast<size_t>(CommKind::Count)> bytes{};  // sent+received by this rank
  double wait_seconds = 0;  // host time blocked in wait()
};

class Communicator;

// An issued collective. wait() blocks until its result can be used (on CUDA: until the current
// stream is ordered after it) and adds the time to the stats. Waiting twice is harmless.
class PendingCollective {
 public:
  PendingCollective();
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, Communicator* comm);
  ~PendingCollective();
  PendingCollective(PendingCollective&&) noexcept;
  PendingCollective& operator=(PendingCollective&&) noexcept;
  void wait();
  bool pending() const;

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  Communicator* comm_ = nullptr;
};

class Communicator {
 public:
  // Rendezvous with the other ranks (TCPStore at world.master_addr:master_port) and create the
  // backend for `device`. Every rank checks that all agree on the world size. Throws a
  // std::runtime_error naming the problem when the rendezvous fails within `timeout`.
  Communicator(const World& world, c10::Device device, std::chrono::milliseconds timeout);
  ~Communicator();

  int64_t rank() const { return world_.rank; }
  int64_t size() const { return world_.size; }
  const World& world() const { return world_; }

  // out (flat, size() * in.numel()) = concatenation of every rank's `in`, in rank order.
  PendingCollective all_gather(at::Tensor& out, at::Tensor& in);
  // out (flat, in.numel() / size()) = this rank's slice of the sum over ranks of `in`.
  PendingCollective reduce_scatter_sum(at::Tensor& out, at::Tensor& in);
  // Sum over ranks, in place.
  PendingCollective all_reduce_sum(at::Tensor& t);
  PendingCollective broadcast(at::Tensor& t, int64_t root);
  // Flat tensors: rank r sends in[sum(in_splits[:d]) ...] to rank d and receives from rank s
  // into out[sum(out_splits[:s]) ...]; splits count elements.
  PendingCollective all_to_all(at::Tensor& out, at::Tensor& in, std::vector<int64_t> out_splits,
                               std::vector<int64_t> in_splits);
  void barrier();

  CommStats& stats() { return stats_; }
  // The rendezvous store (null for a single process), for coordination off the collectives'
  // path (the checkpoint writer's thread uses it).
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

 private:
  friend class PendingCollective;
  void count(CommKind kind, int64_t bytes) { stats_.bytes[static_cast<size_t>(kind)] += bytes; }

  World world_;
  c10::Device device_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  CommStats stats_;
};

// Backends, each in its own translation unit (their headers are heavy and, for Gloo, need
// gloo's headers; see docs/DESIGN.md).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world,
                                                    std::chrono::milliseconds timeout);
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world,
                                                    std::chrono::milliseconds timeout);

}  // namespace zb
