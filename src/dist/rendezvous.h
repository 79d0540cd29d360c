#pragma once
// Meeting the other ranks, off the collectives' path: the c10d TCPStore at
// MASTER_ADDR:MASTER_PORT (rank 0 serves it; under torchrun the elastic agent already does), the
// check that every rank was launched with the same world size, and what goes through the store
// (start-up reports, barriers that block the host, the checkpoint writer's count). Process groups
// (dist/comm.h) are made over it; with a world of one process there is no store.
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dist/world.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace zb {

class Rendezvous {
 public:
  // Connects (or serves) the store and checks that every rank agrees on the world size. Throws a
  // std::runtime_error naming the problem (address, missing rank, mismatched world size) when it
  // fails within `timeout`, which also bounds every later wait on the other ranks.
  Rendezvous(const World& world, std::chrono::milliseconds timeout);
  // The same over a store another party serves (elastic DiLoCo's groups meet under a prefix of
  // the peers' store). Its groups' collectives fail after `timeout` itself: no watchdog stands in
  // front of them, the caller handles their failure.
  Rendezvous(const World& world, std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store> store);

  const World& world() const { return world_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // The collectives' backends stop on their own this long after `timeout()`: later than the
  // watchdog (dist/watchdog.h), which names the stalled step (NCCL's timeout kills the process
  // without that; Gloo's would race with it).
  std::chrono::milliseconds backend_timeout() const;

  // Every rank's `mine`, in rank order (start-up reports).
  std::vector<std::string> exchange(const std::string& key, const std::string& mine) const;
  // Blocks the host until all `count` members of `key` (this one as `member`) have arrived.
  void barrier(const std::string& key, int64_t member, int64_t count) const;
  // The store (null for a single process), for coordination of its own (the checkpoint writer).
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

 private:
  // Every rank publishes its world size and checks everyone else's (throws naming a mismatch or
  // a rank that never arrives).
  void check_world_sizes(bool serving);

  World world_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  bool adopted_store_ = false;
};

// Whether something accepts connections at host:port before `timeout` passes (an address that does
// not resolve counts as reachable: the store's client then names the problem).
bool reachable_within(const std::string& host, int64_t port, std::chrono::milliseconds timeout);

// A shared one (the communicators and start-up exchanges hold it), made where the store's type is
// known.
std::shared_ptr<const Rendezvous> connect_rendezvous(const World& world, std::chrono::milliseconds timeout);

}  // namespace zb
