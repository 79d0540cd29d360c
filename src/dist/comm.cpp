#include "dist/comm.h"
#include "util/phase.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <csignal>
#include <cmath>
#include <exception>
#include <mutex>
#include <stdexcept>

namespace zb {

Transport native_transport(const c10::Device& device) {
  return device.is_cuda() ? Transport::Nccl : Transport::Gloo;
}

const char* transport_name(Transport t) {
  switch (t) {
    case Transport::Nccl: return "nccl";
    case Transport::Gloo: return "gloo";
    case Transport::GlooThroughHost: return "gloo through host memory";
  }
  return "?";
}

PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work, Communicator* comm, at::Tensor result,
                                     at::Tensor destination)
    : work_(std::move(work)), comm_(comm), result_(std::move(result)), destination_(std::move(destination)) {}
PendingCollective::PendingCollective() = default;
PendingCollective::~PendingCollective() = default;
PendingCollective::PendingCollective(PendingCollective&&) noexcept = default;
PendingCollective& PendingCollective::operator=(PendingCollective&&) noexcept = default;
bool PendingCollective::pending() const { return static_cast<bool>(work_); }

void PendingCollective::wait() {
  if (!work_) return;
  Phase phase("zb.wait");  // the host blocked on a collective (on a GPU: the stream made to wait)
  if (comm_->wait_clock_) {
    // NCCL: wait() only makes the current stream wait for the collective; the stream's stall is
    // the time between an event before and one after, read by settle().
    const int before = comm_->wait_clock_->mark();
    work_->wait();
    comm_->wait_marks_.emplace_back(before, comm_->wait_clock_->mark());
  } else {
    const auto start = std::chrono::steady_clock::now();
    work_->wait();  // Gloo: the result is there
    comm_->waited(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  work_.reset();
  if (destination_.defined()) {
    // Through host memory: queued on the current stream from pinned memory (the host allocator
    // keeps the buffer until the copy has run).
    destination_.copy_(result_, /*non_blocking=*/true);
    result_.reset();
    destination_.reset();
  }
}

void Communicator::waited(double seconds) {
  if (watchdog_) watchdog_->progress();
  stats_.wait_seconds += seconds;
  if (parent_) parent_->waited(seconds);
}

void Communicator::settle() {
  for (Communicator* child : children_) child->settle();
  if (wait_clock_ && !wait_marks_.empty()) {
    wait_clock_->synchronize();
    double seconds = 0;
    for (const auto& [before, after] : wait_marks_) seconds += wait_clock_->seconds(before, after);
    wait_marks_.clear();
    wait_clock_->clear();
    waited(seconds);
  }
  if (watchdog_) watchdog_->progress();
}

// Every live backend of a world and its subgroups: what a stall aborts.
struct Communicator::AbortList {
  std::mutex mutex;
  std::vector<c10::intrusive_ptr<c10d::Backend>> backends;
  void add(const c10::intrusive_ptr<c10d::Backend>& b) {
    std::lock_guard<std::mutex> lock(mutex);
    backends.push_back(b);
  }
  void remove(const c10::intrusive_ptr<c10d::Backend>& b) {
    std::lock_guard<std::mutex> lock(mutex);
    backends.erase(std::remove(backends.begin(), backends.end(), b), backends.end());
  }
  void abort_all() {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& b : backends) {
      try {
        b->abort();  // NCCL: ncclCommAbort releases kernels waiting on a dead peer
      } catch (const std::exception&) {
      }
    }
  }
};

size_t Communicator::backends_to_abort() const {
  if (!abort_list_) return 0;
  std::lock_guard<std::mutex> lock(abort_list_->mutex);
  return abort_list_->backends.size();
}

Communicator::Communicator(Communicator* parent, const World& group, const std::string& name,
                           const std::vector<int64_t>& ranks)
    : rendezvous_(parent->rendezvous_), world_(group), name_(name), device_(parent->device_),
      transport_(parent->transport_), parent_(parent), abort_list_(parent->abort_list_) {
  if (!group.distributed()) return;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("zb/pg/" + name, rendezvous_->store());
  const auto timeout = rendezvous_->backend_timeout();
  const bool nccl = transport_ == Transport::Nccl;
  backend_ = nccl ? split_nccl_backend(parent->backend_, prefixed, ranks, timeout)
                  : make_gloo_backend(prefixed, group, timeout);
  if (nccl) wait_clock_ = std::make_unique<StepClock>(device_);
  abort_list_->add(backend_);
}

std::unique_ptr<Communicator> Communicator::subgroup(const std::string& name, const std::vector<int64_t>& ranks) {
  const auto me = std::find(ranks.begin(), ranks.end(), rank());
  TORCH_CHECK(me != ranks.end(), "subgroup ", name, ": rank ", rank(), " is not a member");
  World sub = world_;
  sub.rank = me - ranks.begin();
  sub.size = static_cast<int64_t>(ranks.size());
  // Numbered, so that a later group of the same name (another trainer in the same process) never
  // meets an earlier one's keys in the store: every rank creates its groups in the same order.
  const std::string unique = name + "." + std::to_string(subgroups_created_++);
  auto group = std::unique_ptr<Communicator>(new Communicator(this, sub, unique, ranks));
  children_.push_back(group.get());
  return group;
}

Communicator::Communicator(const World& world, c10::Device device, std::chrono::milliseconds timeout)
    : Communicator(world, device, timeout, native_transport(device)) {}
Communicator::Communicator(const World& world, c10::Device device, std::chrono::milliseconds timeout,
                           Transport transport)
    : Communicator(connect_rendezvous(world, timeout), device, transport) {}

namespace {
// Gloo sends with writev, which raises SIGPIPE when the peer has died, and SIGPIPE's default is
// to end the process without a word. Ignored, the write fails with EPIPE and Gloo's error reaches
// the step, which names it (Python ignores SIGPIPE from the start, so PyTorch's own programs never
// meet this). A handler the program installed itself is left alone.
void ignore_broken_pipes() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
}
}  // namespace

Communicator::Communicator(std::shared_ptr<const Rendezvous> rendezvous, c10::Device device, Transport transport)
    : rendezvous_(std::move(rendezvous)),
      world_(rendezvous_->world()),
      device_(device),
      // Gloo cannot take a GPU's tensors as they are.
      transport_(transport == Transport::Gloo && device.is_cuda() ? Transport::GlooThroughHost : transport) {
  TORCH_CHECK(transport_ != Transport::Nccl || device.is_cuda(), "NCCL carries GPU tensors; this rank's device is ",
              device.str());
  if (!world_.distributed()) return;
  ignore_broken_pipes();
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("zb/pg", rendezvous_->store());
  const auto timeout = rendezvous_->backend_timeout();
  const bool nccl = transport_ == Transport::Nccl;
  backend_ = nccl ? make_nccl_backend(prefixed, world_, device, timeout) : make_gloo_backend(prefixed, world_, timeout);
  if (nccl) wait_clock_ = std::make_unique<StepClock>(device);
  abort_list_ = std::make_shared<AbortList>();
  abort_list_->add(backend_);
  watchdog_ = std::make_unique<Watchdog>(rendezvous_->timeout(), world_.rank, [list = abort_list_] { list->abort_all(); });
}

void Communicator::set_phase(const std::string& phase) {
  if (watchdog_) watchdog_->set_phase(phase);
}

Communicator::~Communicator() {
  watchdog_.reset();  // nothing to watch while tearing down
  if (parent_) parent_->children_.erase(std::remove(parent_->children_.begin(), parent_->children_.end(), this),
                                        parent_->children_.end());
  if (!backend_) return;
  abort_list_->remove(backend_);
  // NCCL's communicators are torn down explicitly: shut down after a normal run, aborted when an
  // error is unwinding (a peer may be dead, and a clean shutdown would wait for it). No-ops for Gloo.
  try {
    if (std::uncaught_exceptions() > 0) backend_->abort();
    else backend_->shutdown();
  } catch (const std::exception&) {
    // Exiting anyway.
  }
}

PendingCollective Communicator::all_gather(const at::Tensor& out, const at::Tensor& in) {
  TORCH_CHECK(out.numel() == in.numel() * size(), "all_gather: output must hold size() inputs");
  const int64_t n = in.numel() * in.element_size();
  account(CommKind::AllGather, n, ring_counted_bytes(CommKind::AllGather, size(), n));
  if (!backend_) {
    out.copy_(in.view(out.sizes()));
    return {};
  }
  // c10d takes non-const handles; flat, as Gloo checks the output is size() inputs along dim 0.
  if (through_host()) {
    at::Tensor output = host_buffer(out).view(-1), input = host_copy(in).view(-1);
    return {backend_->_allgather_base(output, input), this, output, out.view(-1)};
  }
  at::Tensor output = out.view(-1), input = in.view(-1);
  return {backend_->_allgather_base(output, input), this};
}

PendingCollective Communicator::reduce_scatter_sum(const at::Tensor& out, const at::Tensor& in) {
  TORCH_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: input must hold size() outputs");
  const int64_t n = out.numel() * out.element_size();
  account(CommKind::ReduceScatter, n, ring_counted_bytes(CommKind::ReduceScatter, size(), n));
  if (!backend_) {
    out.copy_(in.view(out.sizes()));
    return {};
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;  // Gloo has no AVG: callers pre-divide
  if (through_host()) {
    at::Tensor output = host_buffer(out).view(-1), input = host_copy(in).view(-1);
    return {backend_->_reduce_scatter_base(output, input, opts), this, output, out.view(-1)};
  }
  at::Tensor output = out.view(-1), input = in.view(-1);
  return {backend_->_reduce_scatter_base(output, input, opts), this};
}

PendingCollective Communicator::all_reduce_sum(const at::Tensor& t) { return all_reduce(t, /*largest=*/false); }

PendingCollective Communicator::all_reduce_max(const at::Tensor& t) { return all_reduce(t, /*largest=*/true); }

PendingCollective Communicator::all_reduce(const at::Tensor& t, bool largest) {
  const int64_t bytes = t.numel() * t.element_size();
  account(CommKind::AllReduce, bytes, ring_counted_bytes(CommKind::AllReduce, size(), bytes));
  if (!backend_) return {};
  std::vector<at::Tensor> tensors{through_host() ? host_copy(t) : t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = largest ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  if (through_host()) return {backend_->allreduce(tensors, opts), this, tensors[0], t};
  return {backend_->allreduce(tensors, opts), this};
}

PendingCollective Communicator::broadcast(const at::Tensor& t, int64_t root) {
  TORCH_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank");
  const int64_t bytes = t.numel() * t.element_size();
  account(CommKind::Broadcast, bytes, broadcast_counted_bytes(size(), rank(), root, bytes));
  if (!backend_) return {};
  std::vector<at::Tensor> tensors{through_host() ? host_copy(t) : t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  if (through_host()) return {backend_->broadcast(tensors, opts), this, tensors[0], t};
  return {backend_->broadcast(tensors, opts), this};
}

PendingCollective Communicator::all_to_all(const at::Tensor& out, const at::Tensor& in,
                                           std::vector<int64_t> out_splits,
                                           std::vector<int64_t> in_splits) {
  account(CommKind::AllToAll, in.numel() * in.element_size(),
          all_to_all_counted_bytes(size(), rank(), in.element_size(), in.numel(), out.numel(), in_splits, out_splits));
  if (!backend_) {
    out.copy_(in);
    return {};
  }
  if (through_host()) {
    at::Tensor output = host_buffer(out), input = host_copy(in);
    return {backend_->alltoall_base(output, input, out_splits, in_splits), this, output, out};
  }
  at::Tensor output = out, input = in;
  return {backend_->alltoall_base(output, input, out_splits, in_splits), this};
}

at::Tensor Communicator::host_buffer(const at::Tensor& t) const {
  return at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(device_.is_cuda()));
}

at::Tensor Communicator::host_copy(const at::Tensor& t) const {
  at::Tensor host = host_buffer(t);
  host.copy_(t);  // from a GPU: waits for the stream's work that made `t`
  return host;
}

void Communicator::barrier() {
  rendezvous_->barrier("zb/barrier/" + name_ + "/" + std::to_string(barriers_++), rank(), size());
}

std::vector<int64_t> Communicator::count_over_ranks(const std::vector<bool>& flags) {
  at::Tensor host = at::empty({static_cast<int64_t>(flags.size())}, at::kFloat);
  for (size_t i = 0; i < flags.size(); ++i) host.data_ptr<float>()[i] = flags[i] ? 1.0f : 0.0f;
  at::Tensor t = host.to(device_);
  all_reduce_sum(t).wait();
  t = t.cpu();  // where NCCL's result is really waited for
  settle();
  std::vector<int64_t> counts;
  for (size_t i = 0; i < flags.size(); ++i) counts.push_back(std::lround(t.data_ptr<float>()[i]));
  return counts;
}

}  // namespace zb
