#include "diloco/membership.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dist/rendezvous.h"
#include "util/fault_points.h"
#include "util/log.h"

namespace zb {

namespace peer_keys {
std::string registered() { return "peers/registered"; }
std::string run_fingerprint() { return "peers/fingerprint"; }
std::string heartbeat(int64_t id) { return "peers/replica/" + std::to_string(id) + "/heartbeat"; }
std::string finished(int64_t id) { return "peers/replica/" + std::to_string(id) + "/finished"; }
std::string arrived(int64_t round, int64_t id) {
  return "peers/round/" + std::to_string(round) + "/arrived/" + std::to_string(id);
}
std::string quorum(int64_t round, int64_t attempt) {
  return "peers/round/" + std::to_string(round) + "/" + std::to_string(attempt) + "/quorum";
}
std::string result(int64_t round, int64_t attempt, int64_t id) {
  return "peers/round/" + std::to_string(round) + "/" + std::to_string(attempt) + "/result/" + std::to_string(id);
}
std::string decision(int64_t round, int64_t attempt) {
  return "peers/round/" + std::to_string(round) + "/" + std::to_string(attempt) + "/decision";
}
std::string group_prefix(int64_t generation, int64_t position) {
  return "peers/generation/" + std::to_string(generation) + "/position/" + std::to_string(position);
}
std::string mixed_group_prefix(int64_t generation, int64_t tp_rank) {
  return "peers/generation/" + std::to_string(generation) + "/tp/" + std::to_string(tp_rank);
}
std::string transfer_prefix(int64_t generation, int64_t tp_rank) {
  return mixed_group_prefix(generation, tp_rank) + "/transfer";
}
std::string hello(int64_t id) { return "peers/replica/" + std::to_string(id) + "/hello"; }
std::string shards(int64_t id) { return "peers/replica/" + std::to_string(id) + "/shards"; }
std::string admitted(int64_t id) { return "peers/replica/" + std::to_string(id) + "/admitted"; }
std::string over() { return "peers/over"; }
std::string liveness_port() { return "peers/liveness_port"; }
std::string waiting() { return "peers/waiting"; }
}  // namespace peer_keys

std::vector<uint8_t> store_bytes(const std::string& text) { return {text.begin(), text.end()}; }
std::string store_text(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
std::string id_list(const std::vector<int64_t>& ids) {
  std::string out;
  for (int64_t id : ids) out += (out.empty() ? "" : ",") + std::to_string(id);
  return out;
}

// "generation;id,id,...;stream_rows;change"
std::string Quorum::encode() const {
  return std::to_string(generation) + ";" + id_list(members) + ";" + std::to_string(stream_rows) + ";" + change;
}

Quorum Quorum::decode(const std::string& text) {
  Quorum q;
  std::istringstream in(text);
  std::string generation, ids, rows;
  std::getline(in, generation, ';');
  std::getline(in, ids, ';');
  std::getline(in, rows, ';');
  std::getline(in, q.change);
  q.generation = std::stoll(generation);
  q.stream_rows = std::stoll(rows);
  std::istringstream list(ids);
  for (std::string id; std::getline(list, id, ',');) q.members.push_back(std::stoll(id));
  return q;
}


ReplicaMembership::ReplicaMembership(const std::string& peers, std::chrono::seconds timeout, Communicator& world,
                                     ReplicaPlace place, const std::string& fingerprint, const std::string& join)
    : world_(world), place_(place), where_(peers), timeout_(timeout), leader_(world.rank() == 0), join_(join) {
  const size_t colon = where_.rfind(':');
  const std::string host = where_.substr(0, colon);
  const int64_t port = std::stoll(where_.substr(colon + 1));
  if (!reachable_within(host, port, timeout_))
    throw std::runtime_error("diloco.peers = \"" + where_ + "\": nothing accepts connections there within " +
                             std::to_string(timeout.count()) + " s (is diloco_peers running there?)");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = timeout_;
  try {
    store_ = c10::make_intrusive<c10d::TCPStore>(host, opts);
  } catch (const std::exception& e) {
    throw std::runtime_error("diloco.peers = \"" + where_ + "\": " + e.what());
  }
  if (leader_) {
    // The first replica's fingerprint is the run's; any other must equal it.
    const std::string run = store_text(store_->compareSet(peer_keys::run_fingerprint(), {}, store_bytes(fingerprint)));
    if (run != fingerprint)
      throw std::runtime_error("diloco.peers = \"" + where_ + "\": this replica cannot join the run there: its " +
                               "settings differ from the run's.\n  the run's:  " + run + "\n  this one's: " +
                               fingerprint);
    id_ = store_->add(peer_keys::registered(), 1) - 1;
    store_->add(peer_keys::heartbeat(id_), 1);
    connect_liveness(host);
    store_->set(peer_keys::shards(id_), store_bytes(std::to_string(place_.shards)));
    store_->set(peer_keys::hello(id_), store_bytes(join_.empty() ? "start" : "join " + join_));
    // Its own connection: a wait on the main one must not hold the heartbeat back.
    heartbeat_ = std::thread([this, beat = store_->clone(), id = id_] {
      const auto period = std::max<std::chrono::milliseconds>(std::chrono::milliseconds(50), timeout_ / 20);
      while (!stopping_.load()) {
        try {
          beat->add(peer_keys::heartbeat(id), 1);
        } catch (const std::exception&) {  // the service is gone: the next round says so
        }
        for (auto slept = std::chrono::milliseconds(0); slept < period && !stopping_.load();
             slept += std::chrono::milliseconds(10))
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
  }
  // Every rank of the replica learns its id (the rendezvous' store is the replica's own). A rank
  // lost meanwhile throws here, and the destructor does not run: the heartbeat stops first.
  try {
    id_ = std::stoll(world.rendezvous().exchange("diloco_replica_id", std::to_string(id_)).front());
  } catch (...) {
    stop_heartbeat();
    throw;
  }
  log::info(strf("DiLoCo: replica %ld of the run at diloco.peers %s%s", id_, where_.c_str(),
                 join_.empty() ? "" : ", joining it at its next outer step"));
}

ReplicaMembership::~ReplicaMembership() { stop_heartbeat(); }

void ReplicaMembership::stop_heartbeat() {
  stopping_ = true;
  if (heartbeat_.joinable()) heartbeat_.join();
  if (liveness_fd_ >= 0) ::close(liveness_fd_);
  liveness_fd_ = -1;
}

void ReplicaMembership::connect_liveness(const std::string& host) {
  // Without it the service still sees a lost replica by its heartbeat, only later and without
  // telling a dead process from a stuck one.
  const std::string port = store_text(store_->get(peer_keys::liveness_port()));
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) == 0) {
    liveness_fd_ = ::socket(found->ai_family, found->ai_socktype, found->ai_protocol);
    if (liveness_fd_ >= 0 && (::connect(liveness_fd_, found->ai_addr, found->ai_addrlen) != 0 ||
                              ::send(liveness_fd_, &id_, sizeof id_, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof id_))) {
      ::close(liveness_fd_);
      liveness_fd_ = -1;
    }
    ::freeaddrinfo(found);
  }
  if (liveness_fd_ < 0)
    log::warn("diloco.peers " + where_ + ": no connection to the service's liveness port " + port +
              ": a loss of this replica is seen by its heartbeat only");
}

void ReplicaMembership::finish() {
  // Every rank of the replica is done reading the service's store before the leader says the
  // replica finished: once every replica has, the service closes the store, and a rank still in
  // a read of the last outer step's answers would fail there.
  world_.barrier();
  if (leader_) store_->set(peer_keys::finished(id_), store_bytes("1"));
}

std::string ReplicaMembership::wait_for(const std::string& key, const std::string& phase, const std::string& what,
                                        bool bounded) {
  // The service waits up to runtime.timeout_s for a lost replica's heartbeat before it decides,
  // and a retry repeats that: beyond a few of those it is gone itself. The replica's own
  // watchdog stands down meanwhile (it bounds waits on this replica's ranks, not on the peers).
  world_.set_phase("");
  const auto limit = 4 * timeout_ + std::chrono::seconds(30);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (true) {
    try {
      if (store_->check({key})) break;
      if (!bounded && store_->check({peer_keys::over()}))
        throw std::runtime_error("the run at diloco.peers " + where_ + " ended before " + what);
    } catch (const c10::Error& e) {
      throw std::runtime_error("diloco.peers " + where_ + " stopped answering while waiting for " + what + ": " +
                               e.what_without_backtrace());
    }
    if (bounded && std::chrono::steady_clock::now() > deadline) {
      std::string doing = "is diloco_peers stuck?";
      try {  // what it waits for, in its own words: often a replica alive but not arriving
        if (store_->check({peer_keys::waiting()})) doing = "it is " + store_text(store_->get(peer_keys::waiting()));
      } catch (const c10::Error&) {
      }
      throw std::runtime_error(strf("diloco.peers %s decided no %s within %ld s (%s)", where_.c_str(), what.c_str(),
                                    static_cast<long>(std::chrono::duration_cast<std::chrono::seconds>(limit).count()),
                                    doing.c_str()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  world_.set_phase(phase);
  return store_text(store_->get(key));
}

int64_t ReplicaMembership::shards_of(int64_t id) {
  if (!shards_.count(id)) shards_[id] = std::stoll(store_text(store_->get(peer_keys::shards(id))));
  return shards_[id];
}

void ReplicaMembership::make_groups(const Quorum& q, int64_t index) {
  group_.reset();
  mixed_shards_.clear();
  group_generation_ = q.generation;
  if (q.members.size() == 1) return;
  std::vector<int64_t> shards;
  for (int64_t id : q.members) shards.push_back(shards_of(id));
  const bool uniform = std::all_of(shards.begin(), shards.end(), [&](int64_t s) { return s == place_.shards; });
  try {
    if (uniform) {  // rank for rank: the members' ranks at this world position
      group_ = group_over(peer_keys::group_prefix(q.generation, world_.rank()), index,
                          static_cast<int64_t>(q.members.size()));
    } else {  // every member's ranks at this TP position, member after member
      int64_t before = 0, size = 0;
      for (size_t m = 0; m < shards.size(); ++m) {
        if (static_cast<int64_t>(m) < index) before += shards[m];
        size += shards[m];
      }
      group_ = group_over(peer_keys::mixed_group_prefix(q.generation, place_.tp_rank), before + place_.shard_rank,
                          size);
      mixed_shards_ = shards;
    }
  } catch (const std::exception&) {
    broken_generation_ = q.generation;  // its prefix is spent: its rounds fail until a retry makes a new one
    throw;
  }
}

std::unique_ptr<Communicator> ReplicaMembership::group_over(const std::string& prefix, int64_t rank, int64_t size) {
  World group;
  group.rank = rank;
  group.size = size;
  group.master_addr = where_.substr(0, where_.rfind(':'));
  auto rendezvous =
      std::make_shared<const Rendezvous>(group, timeout_, c10::make_intrusive<c10d::PrefixStore>(prefix, store_));
  return std::make_unique<Communicator>(rendezvous, world_.device(), Transport::Gloo);
}

std::unique_ptr<Communicator> ReplicaMembership::transfer_group(const RoundReport& round) {
  const Quorum& q = round.membership();
  std::vector<int64_t> ids = {round.source};
  ids.insert(ids.end(), round.joined.begin(), round.joined.end());
  if (std::find(ids.begin(), ids.end(), id_) == ids.end()) return nullptr;
  int64_t before = 0, size = 0;
  for (int64_t id : ids) {
    if (id == id_) before = size;
    size += shards_of(id);
  }
  return group_over(peer_keys::transfer_prefix(q.generation, place_.tp_rank), before + place_.shard_rank, size);
}

RoundReport ReplicaMembership::await_admission() {
  const std::string admission = wait_for(peer_keys::admitted(id_), "", "this replica was admitted", /*bounded=*/false);
  // "<round>;<step>;<with optimizer>;<source id>;<joiners>;" + the generation it joins
  RoundReport report;
  std::istringstream in(admission);
  std::string round, step, optimizer, source, joiners, rest;
  std::getline(in, round, ';');
  std::getline(in, step, ';');
  std::getline(in, optimizer, ';');
  std::getline(in, source, ';');
  std::getline(in, joiners, ';');
  std::getline(in, rest);
  report.next = Quorum::decode(rest);
  report.step = std::stoll(step);
  report.with_optimizer = optimizer == "1";
  report.changed = true;
  std::istringstream ids(joiners);
  for (std::string id; std::getline(ids, id, ',');) report.joined.push_back(std::stoll(id));
  report.source = std::stoll(source);
  const auto& members = report.next->members;
  report.member_index = std::find(members.begin(), members.end(), id_) - members.begin();
  generation_ = report.next->generation;
  make_groups(*report.next, report.member_index);
  log::info(strf("DiLoCo: replica %ld admitted at outer step %s, after step %ld (generation %ld)", id_, round.c_str(),
                 report.step, generation_));
  return report;
}

RoundReport ReplicaMembership::start(int64_t stream_rows, int64_t step, int64_t outer_steps) {
  RoundReport report = round(0, step, stream_rows, false, outer_steps, nullptr);
  report.quorum.change = "the run starts";
  return report;
}

RoundReport ReplicaMembership::outer_round(int64_t round_number, int64_t step, int64_t stream_rows, bool last,
                                           const std::function<void(Communicator*)>& exchange) {
  return round(round_number, step, stream_rows, last, round_number - 1, &exchange);
}

RoundReport ReplicaMembership::round(int64_t n, int64_t step, int64_t stream_rows, bool last,
                                     int64_t outer_steps_done, const std::function<void(Communicator*)>* exchange) {
  const auto arrived = std::chrono::steady_clock::now();
  if (leader_) store_->set(peer_keys::arrived(n, id_), store_bytes(strf("%ld;%ld;%d;%ld", stream_rows, step, last ? 1 : 0, outer_steps_done)));
  RoundReport report;
  report.step = step;
  for (int64_t attempt = 0;; ++attempt) {
    const std::string what = n == 0 ? std::string("first membership") : strf("membership for outer step %ld", n);
    const std::string phase = strf("step %ld", n == 0 ? step + 1 : step);  // round 0 comes before its step
    report.quorum = Quorum::decode(wait_for(peer_keys::quorum(n, attempt), phase, what));
    report.attempts = attempt + 1;
    const auto& members = report.quorum.members;
    const auto me = std::find(members.begin(), members.end(), id_);
    if (members.empty())  // the service refused the run's start
      throw std::runtime_error("diloco.peers " + where_ + ": " + report.quorum.change);
    if (me == members.end() && n == 0)
      throw std::runtime_error(strf("replica %ld is not one of the %zu the run at diloco.peers %s started with: set "
                                    "diloco.join = true to join it at its next outer step",
                                    id_, members.size(), where_.c_str()));
    if (me == members.end())
      throw std::runtime_error(strf("replica %ld was left out of the run at outer step %ld (generation %ld: %s): it "
                                    "was taken for lost (no heartbeat within runtime.timeout_s); restart it with "
                                    "diloco.join = true to join again",
                                    id_, n, report.quorum.generation, report.quorum.change.c_str()));
    report.member_index = me - members.begin();
    if (report.quorum.generation != generation_) {  // the time until now went to finding out who is left
      report.changed = true;
      report.seconds_lost = std::chrono::duration<double>(std::chrono::steady_clock::now() - arrived).count();
      generation_ = report.quorum.generation;
    }
    if (!exchange) return report;  // round 0: nothing to exchange
    // The exchange waits on the peers, over groups whose own timeouts (runtime.timeout_s, from each
    // collective's start) turn a lost peer into an error here, a failed round and a retry. The
    // replica's watchdog stands down meanwhile: its clock, started at the quorum, would otherwise end
    // this replica first, for the peer's loss. (A rank of this replica stuck in there is still
    // caught: its own ranks wait for it below.)
    world_.set_phase("");
    bool ok = true;
    std::string error;
    try {
      if (broken_generation_ == generation_)
        throw std::runtime_error(strf("the groups of generation %ld failed at their making", generation_));
      if (group_generation_ != generation_) make_groups(report.quorum, report.member_index);
      fault_point({FaultPoint::ExchangeStart, n, leader_, {}});  // tests: late, lost or frozen here
      (*exchange)(group_.get());
      fault_point({FaultPoint::ExchangeDone, n, leader_, {}});  // tests: lost here, or a failure
    } catch (const std::exception& e) {
      ok = false;
      error = e.what();
    }
    // The replica's ranks agree (their own world is whole), then its leader reports.
    world_.set_phase(phase);
    const bool replica_ok = world_.count_over_ranks({!ok}).front() == 0;
    if (!ok) log::warn(strf("outer step %ld, generation %ld: the exchange failed here: %s", n, report.quorum.generation,
                            error.c_str()));
    if (leader_) store_->set(peer_keys::result(n, attempt, id_), store_bytes(replica_ok ? "ok" : "failed"));
    const std::string decided =
        wait_for(peer_keys::decision(n, attempt), phase, strf("decision on outer step %ld", n));
    if (decided == "commit") return report;
    if (decided.rfind("commit ", 0) == 0) {  // joiners admitted: "commit <with optimizer> <source> <generation>"
      std::istringstream in(decided.substr(7));
      std::string optimizer, source, generation;
      in >> optimizer >> source;
      std::getline(in >> std::ws, generation);
      report.with_optimizer = optimizer == "1";
      report.source = std::stoll(source);
      report.next = Quorum::decode(generation);
      for (int64_t id : report.next->members)
        if (std::find(members.begin(), members.end(), id) == members.end()) report.joined.push_back(id);
      const auto& next = report.next->members;
      report.member_index = std::find(next.begin(), next.end(), id_) - next.begin();
      report.changed = true;
      generation_ = report.next->generation;
      world_.set_phase("");  // waits on the joiners, bounded by the groups' own timeouts
      try {
        make_groups(*report.next, report.member_index);
      } catch (const std::exception& e) {  // the joiner's problem, most likely: the next round settles it
        log::warn(strf("generation %ld: its groups failed at their making: %s", generation_, e.what()));
      }
      world_.set_phase(phase);
      return report;
    }
    if (decided.rfind("stop ", 0) == 0)
      throw std::runtime_error("diloco.peers " + where_ + ": " + decided.substr(5));
    // A member failed: the retry comes with a new generation, and new groups.
  }
}

}  // namespace zb
