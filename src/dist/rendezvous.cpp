#include "dist/rendezvous.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <thread>

namespace zb {

namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string seconds_of(std::chrono::milliseconds t) { return std::to_string(t.count() / 1000) + " s"; }

}  // namespace

// Trying every 50 ms. A rank waits for the store this way before TCPStore's client connects: that
// client retries a timed-out connect once more after a back-off, which turned runtime.timeout_s = 5
// into about 14 s.
bool reachable_within(const std::string& host, int64_t port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return true;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool reached = false;
  while (!reached) {
    for (addrinfo* a = found; a && !reached; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        reached = true;
      } else if (errno == EINPROGRESS) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        pollfd p{fd, POLLOUT, 0};
        int error = 0;
        socklen_t len = sizeof error;
        reached = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count()))) == 1 &&
                  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0;
      }
      ::close(fd);
    }
    if (reached || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::freeaddrinfo(found);
  return reached;
}

Rendezvous::Rendezvous(const World& world, std::chrono::milliseconds timeout) : world_(world), timeout_(timeout) {
  if (!world.distributed()) return;
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(world.master_port);
  // Under torchrun the elastic agent already serves the store on MASTER_PORT.
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  opts.isServer = world.rank == 0 && !(agent_store && std::string(agent_store) == "True");
  opts.numWorkers = static_cast<size_t>(world.size);
  opts.waitWorkers = true;
  opts.timeout = timeout;
  const std::string where = world.master_addr + ":" + std::to_string(world.master_port);
  const std::string failed = "rank " + std::to_string(world.rank) + ": rendezvous at " + where + " failed within " +
                             seconds_of(timeout) + " (is MASTER_ADDR/MASTER_PORT right, and did every rank start?)";
  if (!opts.isServer && !reachable_within(world.master_addr, world.master_port, timeout))
    throw std::runtime_error(failed + ": nothing accepts connections there");
  try {
    store_ = c10::make_intrusive<c10d::TCPStore>(world.master_addr, opts);
  } catch (const std::exception& e) {
    throw std::runtime_error(failed + ": " + e.what());
  }
  // The agent's store outlives a restart of its workers (torchrun --max-restarts): each attempt
  // keeps its keys apart, or a restarted rank would find the last attempt's there.
  if (!opts.isServer && agent_store && std::string(agent_store) == "True")
    if (const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT"))
      store_ = c10::make_intrusive<c10d::PrefixStore>(std::string("zb/attempt_") + attempt, store_);
  check_world_sizes(opts.isServer);
}

Rendezvous::Rendezvous(const World& world, std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store> store)
    : world_(world), timeout_(timeout), store_(std::move(store)), adopted_store_(true) {
  if (world.distributed()) check_world_sizes(/*serving=*/false);
}

void Rendezvous::check_world_sizes(bool serving) {
  const World& world = world_;
  const std::string where = world.master_addr + ":" + std::to_string(world.master_port);
  // Every rank publishes its world size and checks everyone else's: a rank launched with another
  // world size, or one that never arrives, stops every rank with a message instead of a hang.
  const std::string mine = std::to_string(world.size);
  store_->set("zb/world_size_of/" + std::to_string(world.rank), bytes_of(mine));
  std::string mismatch;
  for (int64_t r = 0; r < world.size && mismatch.empty(); ++r) {
    const std::string key = "zb/world_size_of/" + std::to_string(r);
    try {
      store_->wait({key}, timeout_);
    } catch (const std::exception&) {
      throw std::runtime_error("rank " + std::to_string(r) + " did not join the rendezvous at " + where +
                               " within " + seconds_of(timeout_));
    }
    const auto bytes = store_->get(key);
    const std::string theirs(bytes.begin(), bytes.end());
    if (theirs != mine)
      mismatch = "rank " + std::to_string(world.rank) + " was launched with world size " + mine + " but rank " +
                 std::to_string(r) + " with " + theirs;
  }
  if (mismatch.empty()) return;
  // The rank serving the store waits (briefly) until the others have read what they need: leaving
  // at once would take the store away and give them a connection error instead.
  store_->set("zb/world_size_read/" + std::to_string(world.rank), std::vector<uint8_t>{1});
  if (serving) {
    for (int64_t r = 1; r < world.size; ++r) {
      try {
        store_->wait({"zb/world_size_read/" + std::to_string(r)}, std::chrono::seconds(5));
      } catch (const std::exception&) {
      }
    }
  }
  throw std::runtime_error(mismatch);
}

std::chrono::milliseconds Rendezvous::backend_timeout() const {
  if (adopted_store_) return timeout_;
  return timeout_ + std::max<std::chrono::milliseconds>(std::chrono::seconds(10), timeout_ / 10);
}

std::shared_ptr<const Rendezvous> connect_rendezvous(const World& world, std::chrono::milliseconds timeout) {
  return std::make_shared<const Rendezvous>(world, timeout);
}

std::vector<std::string> Rendezvous::exchange(const std::string& key, const std::string& mine) const {
  if (!store_) return {mine};
  store_->set("zb/" + key + "/" + std::to_string(world_.rank), bytes_of(mine));
  std::vector<std::string> all;
  for (int64_t r = 0; r < world_.size; ++r) {
    const auto bytes = store_->get("zb/" + key + "/" + std::to_string(r));  // waits up to the timeout
    all.emplace_back(bytes.begin(), bytes.end());
  }
  return all;
}

void Rendezvous::barrier(const std::string& key, int64_t member, int64_t count) const {
  if (!store_ || count == 1) return;
  // Each member sets its own key and waits for everyone's: the host blocks, whatever the backend
  // (an NCCL all-reduce's wait would only order the GPU's stream).
  store_->set(key + "/" + std::to_string(member), std::vector<uint8_t>{1});
  std::vector<std::string> keys;
  for (int64_t m = 0; m < count; ++m) keys.push_back(key + "/" + std::to_string(m));
  try {
    store_->wait(keys, timeout_);
  } catch (const std::exception&) {
    throw std::runtime_error("rank " + std::to_string(world_.rank) + ": not every rank reached the barrier within " +
                             seconds_of(timeout_) + " (one may have died or hung)");
  }
}

}  // namespace zb
