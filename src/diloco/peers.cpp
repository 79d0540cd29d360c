#include "diloco/peers.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <stdexcept>
#include <map>
#include <thread>
#include <vector>

#include "diloco/membership.h"
#include "util/log.h"

namespace zb {

namespace {

using Clock = std::chrono::steady_clock;

// Attempts at one outer step before the run stops: a lost peer costs one, so more in a row is an
// error that repeats (a bug, a disk, a link that never carries the exchange).
constexpr int64_t kMaxAttempts = 5;

enum class Answer { None, Yes, Left, Lost };

// A replica's arrival at a round (peer_keys::arrived).
struct Arrival {
  int64_t stream_rows = 0, step = 0;
  bool last = false;
  int64_t outer_steps_done = 0;
};
Arrival parse_arrival(const std::string& text) {
  Arrival a;
  char last = '0';
  if (std::sscanf(text.c_str(), "%ld;%ld;%c;%ld", &a.stream_rows, &a.step, &last, &a.outer_steps_done) != 4)
    throw std::runtime_error("a replica's arrival \"" + text + "\" does not parse");
  a.last = last == '1';
  return a;
}


// The service's view of the replicas. Two signs: each leader's heartbeat in the store, and a TCP
// connection it keeps open to the service (peer_keys::liveness_port). A closed connection means the
// leader's process is gone (killed, crashed, exited): lost at once, "died". A heartbeat silent for
// the timeout with the connection still open means a process stopped or stuck: "hung".
class Liveness {
 public:
  Liveness(c10d::Store& store, std::chrono::milliseconds timeout) : store_(store), timeout_(timeout) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in any{};
    any.sin_family = AF_INET;
    any.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof any;
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&any), len) != 0 || ::listen(listener_, 64) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&any), &len) != 0)
      throw std::runtime_error(std::string("cannot listen for the replicas' connections: ") + std::strerror(errno));
    store_.set(peer_keys::liveness_port(), store_bytes(std::to_string(ntohs(any.sin_port))));
  }
  ~Liveness() {
    for (const auto& [id, fd] : connections_) ::close(fd);
    ::close(listener_);
  }

  // Whether replica `id` still counts as alive; once not, why() says why.
  bool alive(int64_t id) {
    accept_new();
    if (const auto c = connections_.find(id); c != connections_.end()) {
      pollfd p{c->second, POLLIN, 0};
      char byte;
      if (::poll(&p, 1, 0) == 1 && ::recv(c->second, &byte, 1, MSG_PEEK | MSG_DONTWAIT) <= 0) {
        why_[id] = "died: its process is gone";
        return false;
      }
    }
    const int64_t beat = store_.add(peer_keys::heartbeat(id), 0);
    Seen& seen = seen_[id];
    if (beat != seen.beat) seen = {beat, Clock::now()};
    if (Clock::now() - seen.since <= timeout_) return true;
    const double silent = std::chrono::duration<double>(Clock::now() - seen.since).count();
    why_[id] = connections_.count(id) ? strf("hung: no heartbeat for %.1f s, its process still there", silent)
                                      : strf("lost: no heartbeat for %.1f s", silent);
    return false;
  }
  const std::string& why(int64_t id) { return why_[id]; }

 private:
  // Replicas' new connections, each announcing its id (8 bytes).
  void accept_new() {
    for (int fd; (fd = ::accept(listener_, nullptr, nullptr)) >= 0;) {
      int64_t id = -1;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 1000) == 1 && ::recv(fd, &id, sizeof id, MSG_WAITALL) == static_cast<ssize_t>(sizeof id) &&
          id >= 0)
        connections_[id] = fd;
      else
        ::close(fd);
    }
  }

  struct Seen {
    int64_t beat = -1;
    Clock::time_point since;
  };
  c10d::Store& store_;
  std::chrono::milliseconds timeout_;
  std::map<int64_t, Seen> seen_;
  int listener_ = -1;
  std::map<int64_t, int> connections_;
  std::map<int64_t, std::string> why_;
};

}  // namespace

int serve_peers(const PeersOptions& options, const std::function<void(const std::string&)>& say) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(options.port);
  opts.isServer = true;
  opts.waitWorkers = false;
  opts.timeout = options.timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  say(strf("serving the membership of %ld replica(s) on port %ld; a replica whose heartbeat stops for %ld s is "
           "taken for lost",
           options.replicas, options.port, static_cast<long>(options.timeout.count() / 1000)));
  Liveness liveness(*store, options.timeout);
  const auto nap = [] { std::this_thread::sleep_for(std::chrono::milliseconds(10)); };
  // Polls `ids` until each has answered (returned: those that answered Yes, in order) or is lost
  // (named in `change`); a replica that answers Left (finished) is neither.
  const auto await = [&](const std::vector<int64_t>& ids, const std::function<Answer(int64_t)>& answer,
                         const std::string& when, std::string& change) {
    std::map<int64_t, Answer> answers;
    std::string said;  // what the replicas read while they wait (peer_keys::waiting)
    while (answers.size() < ids.size()) {
      std::vector<int64_t> missing;
      for (int64_t id : ids)
        if (!answers.count(id)) missing.push_back(id);
      if (const std::string now = "waiting " + when + " for replica(s) " + id_list(missing); now != said)
        store->set(peer_keys::waiting(), store_bytes(said = now));
      for (int64_t id : ids) {
        if (answers.count(id)) continue;
        const Answer a = answer(id);
        if (a != Answer::None) {
          answers[id] = a;
        } else if (!liveness.alive(id)) {
          answers[id] = Answer::Lost;
          change += strf("%sreplica %ld lost %s (%s)", change.empty() ? "" : "; ", id, when.c_str(),
                         liveness.why(id).c_str());
        }
      }
      if (answers.size() < ids.size()) nap();
    }
    std::vector<int64_t> yes;
    for (int64_t id : ids)
      if (answers[id] == Answer::Yes) yes.push_back(id);
    return yes;
  };

  // A generation's members as the log names them, with their shard counts where those differ.
  const auto members_text = [&](const std::vector<int64_t>& ids) {
    std::vector<int64_t> shards;
    for (int64_t id : ids) shards.push_back(std::stoll(store_text(store->get(peer_keys::shards(id)))));
    const bool mixed = std::any_of(shards.begin(), shards.end(), [&](int64_t s) { return s != shards.front(); });
    return id_list(ids) + (mixed ? " of " + id_list(shards) + " shards" : "");
  };
  // Registrations by kind (a replica's hello says it), each read once written.
  std::map<int64_t, std::string> hellos;
  std::vector<int64_t> admitted;  // joiners already let in
  const auto read_hellos = [&] {
    const int64_t registered = store->add(peer_keys::registered(), 0);
    for (int64_t id = 0; id < registered; ++id)
      if (!hellos.count(id) && store->check({peer_keys::hello(id)}))
        hellos[id] = store_text(store->get(peer_keys::hello(id)));
  };
  const auto starting = [&] {
    std::vector<int64_t> ids;
    for (const auto& [id, hello] : hellos)
      if (hello == "start") ids.push_back(id);
    return ids;
  };
  // Joiners waiting to be let in, alive.
  const auto waiting_joiners = [&] {
    read_hellos();
    std::vector<int64_t> ids;
    for (const auto& [id, hello] : hellos)
      if (hello.rfind("join", 0) == 0 && std::find(admitted.begin(), admitted.end(), id) == admitted.end() &&
          liveness.alive(id))
        ids.push_back(id);
    return ids;
  };

  // Round 0: the first generation, once the expected replicas have registered and arrived. A
  // resumed run's replicas bring where their checkpoints left the stream and the outer steps.
  for (int64_t said = -1; read_hellos(), static_cast<int64_t>(starting().size()) < options.replicas; nap())
    if (const int64_t n = static_cast<int64_t>(starting().size()); n != said)
      store->set(peer_keys::waiting(), store_bytes(strf("waiting for the run's replicas to register: %ld of %ld so far",
                                                        said = n, options.replicas)));
  std::vector<int64_t> members = starting(), generation_members;
  members.resize(static_cast<size_t>(options.replicas));
  std::string change;  // why the next generation differs
  const std::vector<int64_t> arrived = await(
      members, [&](int64_t id) { return store->check({peer_keys::arrived(0, id)}) ? Answer::Yes : Answer::None; },
      "at the start", change);
  std::map<std::string, std::vector<int64_t>> positions;  // "<stream rows>;<outer steps>" -> replicas
  for (int64_t id : arrived) {
    const Arrival a = parse_arrival(store_text(store->get(peer_keys::arrived(0, id))));
    positions[strf("stream row %ld, %ld outer steps", a.stream_rows, a.outer_steps_done)].push_back(id);
  }
  if (arrived.size() != members.size() || positions.size() != 1) {
    std::string why = change;
    for (const auto& [where, ids] : positions)
      why += strf("%sreplica(s) %s at %s", why.empty() ? "" : "; ", id_list(ids).c_str(), where.c_str());
    why = "the run cannot start: " + why + " (replicas resumed together must come from the same step)";
    store->set(peer_keys::quorum(0, 0), store_bytes(Quorum{0, {}, 0, why}.encode()));
    store->set(peer_keys::over(), store_bytes("1"));
    say(why);
    std::this_thread::sleep_for(std::chrono::seconds(2));  // for the replicas to read it
    return 1;
  }
  const Arrival start = parse_arrival(store_text(store->get(peer_keys::arrived(0, members.front()))));
  int64_t generation = 1;
  generation_members = members;
  store->set(peer_keys::quorum(0, 0),
             store_bytes(Quorum{generation, members, start.stream_rows, "the run starts"}.encode()));
  say(strf("generation 1: replicas %s%s", members_text(members).c_str(),
           start.outer_steps_done > 0 ? strf(" (resumed after %ld outer steps)", start.outer_steps_done).c_str() : ""));

  for (int64_t round = start.outer_steps_done + 1;; ++round) {
    // Who arrives at this outer step: every member, less those finished or lost on the way.
    std::vector<int64_t> present = await(
        members,
        [&](int64_t id) {
          if (store->check({peer_keys::finished(id)})) return Answer::Left;
          return store->check({peer_keys::arrived(round, id)}) ? Answer::Yes : Answer::None;
        },
        strf("before outer step %ld", round), change);
    std::vector<int64_t> finished;
    for (int64_t id : members)
      if (store->check({peer_keys::finished(id)})) finished.push_back(id);
    if (present.empty()) {
      store->set(peer_keys::over(), store_bytes("1"));
      if (!finished.empty()) {  // one lost after its last outer step does not undo the others' finish
        say(strf("the run is over: replicas %s finished%s", id_list(finished).c_str(),
                 change.empty() ? "" : (" (" + change + ")").c_str()));
        // Joiners still waiting read that the run is over before the store goes.
        if (!waiting_joiners().empty()) std::this_thread::sleep_for(std::chrono::seconds(2));
        return 0;
      }
      say("every replica is lost (" + change + "): nothing left to coordinate");
      return 1;
    }
    // Where the members stand, the same for each.
    const Arrival at = parse_arrival(store_text(store->get(peer_keys::arrived(round, present.front()))));
    const int64_t stream_rows = at.stream_rows;
    for (int64_t attempt = 0;; ++attempt) {
      const bool changed = present != generation_members;
      if (changed) {
        ++generation;
        generation_members = present;
        say(strf("generation %ld at outer step %ld: replicas %s (%s)", generation, round, members_text(present).c_str(),
                 change.c_str()));
      }
      const std::string why = changed ? change : "";
      store->set(peer_keys::quorum(round, attempt),
                 store_bytes(Quorum{generation, present, stream_rows, why}.encode()));
      // Each member's outcome, or its loss.
      std::vector<int64_t> failed;
      change.clear();
      const std::vector<int64_t> reported = await(
          present,
          [&](int64_t id) {
            if (!store->check({peer_keys::result(round, attempt, id)})) return Answer::None;
            if (store_text(store->get(peer_keys::result(round, attempt, id))) != "ok") failed.push_back(id);
            return Answer::Yes;
          },
          strf("in outer step %ld", round), change);
      if (!failed.empty())
        change += strf("%sthe exchange failed on replica(s) %s", change.empty() ? "" : "; ", id_list(failed).c_str());
      if (reported.empty()) {
        say("every replica is lost (" + change + "): nothing left to coordinate");
        return 1;
      }
      // Those who reported success all hold the same average; one failure means some may not. A
      // failure that comes back attempt after attempt is no lost peer: the run stops, naming it.
      if (!failed.empty() && attempt + 1 >= kMaxAttempts) {
        const std::string why = strf("outer step %ld failed %ld times in a row (last: %s): the run stops (see the "
                                     "replicas' logs for the error)", round, kMaxAttempts, change.c_str());
        store->set(peer_keys::decision(round, attempt), store_bytes("stop " + why));
        store->set(peer_keys::over(), store_bytes("1"));
        say(why);
        std::this_thread::sleep_for(std::chrono::seconds(2));  // for the replicas to read it
        return 1;
      }
      if (!failed.empty()) {
        store->set(peer_keys::decision(round, attempt), store_bytes("retry"));
      } else {
        members = reported;  // one lost after a good exchange leaves at the next round, `change` saying why
        std::string decision = "commit";
        if (const std::vector<int64_t> joiners = at.last ? std::vector<int64_t>{} : waiting_joiners(); !joiners.empty()) {
          // The next generation: the members and the joiners, the lowest id sending them its state.
          std::vector<int64_t> next = members;
          next.insert(next.end(), joiners.begin(), joiners.end());
          std::sort(next.begin(), next.end());
          bool with_optimizer = false;
          for (int64_t id : joiners) with_optimizer = with_optimizer || hellos[id] == "join peer";
          const std::string joined = strf("replica(s) %s joined after outer step %ld", id_list(joiners).c_str(), round);
          const Quorum q{++generation, next, stream_rows, change.empty() ? joined : change + "; " + joined};
          for (int64_t id : joiners)
            store->set(peer_keys::admitted(id),
                       store_bytes(strf("%ld;%ld;%d;%ld;%s;", round, at.step, with_optimizer ? 1 : 0, members.front(),
                                     id_list(joiners).c_str()) +
                                q.encode()));
          decision = strf("commit %d %ld ", with_optimizer ? 1 : 0, members.front()) + q.encode();
          admitted.insert(admitted.end(), joiners.begin(), joiners.end());
          members = generation_members = next;
          change.clear();
          say(strf("generation %ld after outer step %ld: replicas %s (%s)", generation, round, members_text(next).c_str(),
                   q.change.c_str()));
        }
        store->set(peer_keys::decision(round, attempt), store_bytes(decision));
        break;
      }
      say(strf("outer step %ld: retried without the failed exchange (%s)", round, change.c_str()));
      present = reported;
      generation_members.clear();  // a retry always gets new groups
    }
  }
}

}  // namespace zb
