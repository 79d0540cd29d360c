#pragma once
// A process group for the training engine, on PyTorch's c10d: one backend over a rendezvous
// (dist/rendezvous.h): NCCL between GPUs, Gloo over TCP for host tensors, or Gloo for a GPU's
// tensors staged through host memory (ranks that share a GPU, which NCCL refuses). Every call
// counts the bytes it moves by kind, and waiting on results is timed, for the per-step metrics.
// With a world of one process nothing is created and every collective is a local copy.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "dist/comm_bytes.h"
#include "dist/rendezvous.h"
#include "dist/watchdog.h"
#include "dist/world.h"
#include "util/device.h"

namespace c10d {
class Backend;
class Work;
}  // namespace c10d

namespace zb {

// Sees every collective a Communicator issues, as it issues it (the step trace,
// parallel/step_trace.h). `payload` is the call's bytes as the convention names them (for
// all_to_all: the input's bytes); `counted` what the statistics count.
class CollectiveObserver {
 public:
  virtual ~CollectiveObserver() = default;
  virtual void collective(CommKind kind, const std::string& group, int64_t ranks, int64_t payload,
                          int64_t counted) = 0;
};

struct CommStats {
  std::array<int64_t, static_cast<size_t>(CommKind::Count)> bytes{};  // see above
  // Time the computation stood waiting for collectives in wait(): the host's time blocked on CPU
  // (Gloo's wait returns when the result is there); on a GPU the time the compute stream stood
  // still (an event before and after the stream's wait on NCCL's), counted once settle() has
  // read them.
  double wait_seconds = 0;
};

class Communicator;

// How a group's collectives travel (runtime.backend; dist/placement.h chooses).
enum class Transport {
  Nccl,  // GPU to GPU, one rank per GPU
  Gloo,  // host tensors over TCP; a GPU's tensors go as GlooThroughHost
  // Gloo on host copies: each input copied to (pinned) host memory before the call, each result
  // copied back to the device when the call is waited for. What a GPU's tensors take under Gloo
  // (c10d's Gloo has no CUDA path for several of our collectives); on the CPU, for tests, the
  // same through separate host buffers. The engines see no difference.
  GlooThroughHost,
};
// The device's own: NCCL for a GPU, Gloo for the CPU.
Transport native_transport(const c10::Device& device);
const char* transport_name(Transport t);  // "nccl", "gloo", "gloo through host memory"

// An issued collective. wait() blocks until its result can be used (on CUDA: until the current
// stream is ordered after it: the host goes on at once) and times the wait (CommStats). Waiting
// twice is harmless.
class PendingCollective {
 public:
  PendingCollective();
  // `result`, where given, is a host copy that wait() copies into `destination` (GlooThroughHost).
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, Communicator* comm, at::Tensor result = {},
                    at::Tensor destination = {});
  ~PendingCollective();
  PendingCollective(PendingCollective&&) noexcept;
  PendingCollective& operator=(PendingCollective&&) noexcept;
  void wait();
  bool pending() const;

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  Communicator* comm_ = nullptr;
  at::Tensor result_, destination_;
};

class Communicator {
 public:
  // The world's group over `rendezvous`, for `device`'s tensors, by `transport` (the device's own
  // unless given; Gloo for a GPU means GlooThroughHost). The rendezvous' timeout also bounds
  // every wait on the other ranks while a phase is set (set_phase).
  Communicator(std::shared_ptr<const Rendezvous> rendezvous, c10::Device device, Transport transport);
  // The same over a rendezvous of its own (Rendezvous's constructor: throws naming the problem).
  Communicator(const World& world, c10::Device device, std::chrono::milliseconds timeout);
  Communicator(const World& world, c10::Device device, std::chrono::milliseconds timeout, Transport transport);
  ~Communicator();

  // A communicator over some of this one's ranks (`ranks`, in their new order; this rank among
  // them), for hybrid sharding's shard and replicate groups. Every member calls it with the same
  // `name` and ranks; groups of different names may share ranks. It has its own backend over the
  // same store; its collectives count in its own statistics and in this one's (so the step
  // record's totals stay whole), and progress on it satisfies this one's watchdog. A group of
  // one rank is local. Must not outlive this communicator.
  std::unique_ptr<Communicator> subgroup(const std::string& name, const std::vector<int64_t>& ranks);

  // This rank and the group's size (a subgroup's own numbering).
  int64_t rank() const { return world_.rank; }
  int64_t size() const { return world_.size; }
  const World& world() const { return world_; }
  const Rendezvous& rendezvous() const { return *rendezvous_; }
  Transport transport() const { return transport_; }
  const c10::Device& device() const { return device_; }

  // out (flat, size() * in.numel()) = concatenation of every rank's `in`, in rank order.
  PendingCollective all_gather(const at::Tensor& out, const at::Tensor& in);
  // out (flat, in.numel() / size()) = this rank's slice of the sum over ranks of `in`.
  PendingCollective reduce_scatter_sum(const at::Tensor& out, const at::Tensor& in);
  // Sum over ranks, in place.
  PendingCollective all_reduce_sum(const at::Tensor& t);
  // Largest over ranks, in place.
  PendingCollective all_reduce_max(const at::Tensor& t);
  PendingCollective broadcast(const at::Tensor& t, int64_t root);
  // Flat tensors: rank r sends in[sum(in_splits[:d]) ...] to rank d and receives from rank s
  // into out[sum(out_splits[:s]) ...]; splits count elements.
  PendingCollective all_to_all(const at::Tensor& out, const at::Tensor& in, std::vector<int64_t> out_splits,
                               std::vector<int64_t> in_splits);
  // Blocks the host until every rank of this group has called it (through the store, so on NCCL
  // too, where a collective's wait only orders the GPU's stream).
  void barrier();
  // The host has seen everything issued so far complete (after a host read of a result): reads
  // the GPU's wait times into stats() and tells the watchdog the collectives progressed. On the
  // CPU only the latter (waits are timed as they happen). Cheap; its subgroups' too.
  void settle();
  // The part of the run now under way ("step 12", "evaluation after step 12"; "" for none), named
  // when it stalls: while one is set, a rank that sees no collective complete for `timeout`
  // logs it, aborts the backend and exits with code 1 (dist/watchdog.h).
  void set_phase(const std::string& phase);
  // For agreeing on conditions (a signal, a failed save): how many ranks have each flag set.
  // One all-reduce and one host read.
  std::vector<int64_t> count_over_ranks(const std::vector<bool>& flags);

  // What this group has moved and waited so far (its subgroups' included).
  CommStats stats() const { return stats_; }
  // Reports this communicator's collectives (not its subgroups') to `observer` under the name
  // `group` ("world", "shard", "replicate"); null stops it.
  void observe(CollectiveObserver* observer, std::string group) {
    observer_ = observer;
    observed_as_ = std::move(group);
  }
  // Backends the watchdog aborts on a stall: this group's and its live subgroups' (all of them).
  size_t backends_to_abort() const;

 private:
  friend class PendingCollective;
  Communicator(Communicator* parent, const World& group, const std::string& name, const std::vector<int64_t>& ranks);
  void count(CommKind kind, int64_t bytes) {
    stats_.bytes[static_cast<size_t>(kind)] += bytes;
    if (parent_) parent_->count(kind, bytes);
  }
  // One issued call: counted, and shown to the observer.
  void account(CommKind kind, int64_t payload, int64_t counted) {
    count(kind, counted);
    if (observer_) observer_->collective(kind, observed_as_, size(), payload, counted);
  }
  void waited(double seconds);
  PendingCollective all_reduce(const at::Tensor& t, bool largest);  // the sum, or the largest
  // GlooThroughHost: a host copy of `t` (pinned for a GPU's, so that the copy back can be queued
  // on the stream), and an uninitialised one of its shape for a result.
  at::Tensor host_copy(const at::Tensor& t) const;
  at::Tensor host_buffer(const at::Tensor& t) const;
  bool through_host() const { return transport_ == Transport::GlooThroughHost; }

  std::shared_ptr<const Rendezvous> rendezvous_;
  World world_;       // the rendezvous' world, or a subgroup's numbering of it
  std::string name_;  // "" for the world; a subgroup's unique name
  c10::Device device_;
  Transport transport_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  CommStats stats_;
  CollectiveObserver* observer_ = nullptr;
  std::string observed_as_;
  std::unique_ptr<Watchdog> watchdog_;  // distributed runs only; a subgroup uses its parent's
  Communicator* parent_ = nullptr;       // a subgroup's
  std::vector<Communicator*> children_;  // live subgroups
  int64_t subgroups_created_ = 0, barriers_ = 0;
  // Every live backend of the world and its subgroups, shared with the watchdog's abort.
  struct AbortList;
  std::shared_ptr<AbortList> abort_list_;
  // GPU: the wait times' events, in pairs (before, after), until settle() reads them.
  std::unique_ptr<StepClock> wait_clock_;
  std::vector<std::pair<int, int>> wait_marks_;
};

// Backends, each in its own translation unit (their headers are heavy and, for Gloo, need
// gloo's headers; see docs/DESIGN.md).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world,
                                                    std::chrono::milliseconds timeout);
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world, const c10::Device& device,
                                                    std::chrono::milliseconds timeout);
// A subgroup's NCCL backend split from its parent's communicator (ncclCommSplit): it shares the
// parent's connections and buffers instead of setting up its own. Every rank of the parent
// must call it at the same point, each with its own group's `ranks` (ranks of the parent).
c10::intrusive_ptr<c10d::Backend> split_nccl_backend(const c10::intrusive_ptr<c10d::Backend>& parent,
                                                     const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::vector<int64_t>& ranks,
                                                     std::chrono::milliseconds timeout);
// Both live in the GPU plugin (util/cuda_plugin.h; dist/nccl_backend.cpp) and are called through
// this table (dist/nccl_calls.cpp).
struct NcclFunctions {
  c10::intrusive_ptr<c10d::Backend> (*make)(const c10::intrusive_ptr<c10d::Store>& store, const World& world,
                                            const c10::Device& device, std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Backend> (*split)(const c10::intrusive_ptr<c10d::Backend>& parent,
                                             const c10::intrusive_ptr<c10d::Store>& store,
                                             const std::vector<int64_t>& ranks, std::chrono::milliseconds timeout);
};

}  // namespace zb

// The plugin's entry for this table.
extern "C" const zb::NcclFunctions* zb_nccl_functions(std::size_t table_bytes);
