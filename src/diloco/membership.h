#pragma once
// Elastic DiLoCo (diloco.peers = "host:port"): replicas that may leave while the others train on.
//
// Each replica is a launch of its own (its own torchrun or srun, its own rendezvous and world).
// The replicas meet at a membership store served by `diloco_peers` (diloco/peers.h), which decides
// who takes part in each round:
//   round 0      the start: the first generation, once the expected replicas have registered;
//   round n > 0  outer step n: the replicas that arrived at it, less those lost on the way.
// A generation is one membership (its members' ids, in order). The replicate groups (Gloo, one
// per position in the replica's world) are made for a generation over the peers' store under
// its own prefix, and kept until the membership changes: c10d groups cannot shrink.
//
// A round, on every rank of a replica:
//   1. its leader (world rank 0) says it has arrived, with the data position it has reached;
//   2. every rank reads the round's quorum (generation, members, data position): a replica lost
//      since (no heartbeat within runtime.timeout_s) is not in it;
//   3. the exchange over the generation's groups (outer steps only); any failure there, a peer
//      dying mid-exchange for example, is caught;
//   4. the replica agrees on its outcome over its own world, and its leader reports it;
//   5. every rank reads the decision: "commit" when every member that reported succeeded (they
//      then hold the same average, the lost member's sent values included), else "retry" over the
//      members that reported, up to 5 attempts, then "stop". Nobody applies an exchange the others
//      discard.
//
// Joining (diloco.join = true): a replica that registers as a joiner waits while the others train.
// At the next outer step they commit, the service admits it: the decision carries the next
// generation (the members and the joiners), every one of them makes its groups, and the member
// with the lowest id of those that reported (the decision names it) sends the joiner its state
// (DiLoCoHook::share_state). The joiner trains on from the step after. A replica's registration says
// how it takes part ("start", "join fresh", "join peer"); the service reads it only once written,
// so that a joiner is never counted among those the run starts with.
//
// Shard counts: a replica's ranks hold each parameter's rows split over its shard count (its world
// over its TP degree), which may differ between replicas; the TP degree may not (the fingerprint
// says so). A generation whose members all have one shard count exchanges rank for rank, a group
// per world position. Otherwise (a mixed generation) one group per TP position spans every member's
// ranks, member after member, and the exchange moves rows to owners and back (dist/row_moves.h,
// DiLoCo::mixed_mean). A joiner's state travels the same way, from the source's layout into its own.
//
// The data (DataLoader::reposition): the run reads one stream of rows. In a generation of m
// members that began after step t0 at stream row P, member k reads rows
// P + (t - t0 - 1)·m·B + k·B + [0, B) in step t (B = optim.batch_size, each replica's batch). The next
// generation begins where this one's steps ended, so no row is read twice; the rows a lost
// replica read since the last outer step are lost with its work.
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/comm.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace zb {

// The store's keys, written by the replicas and the peers service alike.
namespace peer_keys {
std::string registered();                                  // counter: ids handed out
std::string run_fingerprint();                             // the first replica's; every other must match
std::string heartbeat(int64_t id);                         // counter the replica's leader bumps
std::string finished(int64_t id);                          // the replica trained its last step
// "<stream rows read>;<step>;<last 0|1>;<outer steps done before>"
std::string arrived(int64_t round, int64_t id);
std::string quorum(int64_t round, int64_t attempt);        // value: Quorum::encode()
std::string result(int64_t round, int64_t attempt, int64_t id);  // "ok" | "failed"
// "commit", "retry", "stop <why>" (the service gave up on the round), or a commit that admits
// joiners: "commit <with optimizer 0|1> <source id> " + the next generation's Quorum (the joiners
// take the optimizer state too when one of them asked for it; the source sends them their state).
std::string decision(int64_t round, int64_t attempt);
std::string group_prefix(int64_t generation, int64_t position);
std::string mixed_group_prefix(int64_t generation, int64_t tp_rank);  // a mixed generation's
std::string transfer_prefix(int64_t generation, int64_t tp_rank);
std::string hello(int64_t id);     // "start" | "join fresh" | "join peer"
std::string shards(int64_t id);    // the replica's shard count, written before its hello
// A joiner's admission: "<round>;<step>;<with optimizer 0|1>;<id of the member sending the state>;<the
// joiners' ids, comma-separated>;" + Quorum
std::string admitted(int64_t id);
std::string over();                // the run has ended
std::string liveness_port();       // where each leader keeps a connection open (diloco/peers.cpp)
std::string waiting();             // what the service waits for now, in words
}  // namespace peer_keys

// The store holds bytes; the protocol's values are text. Replica ids as the protocol and the log
// write them: "0,2,3".
std::vector<uint8_t> store_bytes(const std::string& text);
std::string store_text(const std::vector<uint8_t>& bytes);
std::string id_list(const std::vector<int64_t>& ids);

// One round's membership as the peers service decided it.
struct Quorum {
  int64_t generation = 0;
  std::vector<int64_t> members;  // replica ids, ascending
  int64_t stream_rows = 0;       // rows of the run's stream read before this generation's steps
  std::string change;            // why the membership changed ("" when it did not)

  std::string encode() const;
  static Quorum decode(const std::string& text);
};

// What a round did, for the step's record.
struct RoundReport {
  Quorum quorum;                 // who took part in the exchange (round 0: the first generation)
  std::optional<Quorum> next;    // the generation after it, when the round admitted joiners
  int64_t member_index = 0;      // this replica's place in membership().members
  bool changed = false;          // this replica trains on in a new generation (always at round 0)
  int64_t attempts = 1;
  double seconds_lost = 0;       // from arrival to the final quorum, when the membership changed
  std::vector<int64_t> joined;   // the joiners admitted (in next)
  bool with_optimizer = false;   // they take the optimizer state too
  int64_t step = 0;              // the step the round came after
  int64_t source = -1;           // who sends the joiners their state (the service names it)

  // The generation this replica trains in from the next step.
  const Quorum& membership() const { return next ? *next : quorum; }
  // Whether this replica sends the joiners their state.
  bool sends_state() const { return membership().members.at(static_cast<size_t>(member_index)) == source; }
};

// Where a rank sits in its replica: the replica's shard count, this rank's place among them, and
// its TP rank (parallel/mesh.h).
struct ReplicaPlace {
  int64_t shards = 1, shard_rank = 0, tp_rank = 0;
};

class ReplicaMembership {
 public:
  // Connects to `peers` (diloco.peers; throws naming the address when nothing answers within
  // `timeout`, runtime.timeout_s). Rank 0 of `world` (the replica's own) registers the replica, checks its
  // fingerprint (model, batch, DiLoCo settings: a replica that differs is refused) and keeps
  // its heartbeat.
  // `join`: "" to start with the run, "fresh" or "peer" to join it (diloco.join_state).
  ReplicaMembership(const std::string& peers, std::chrono::seconds timeout, Communicator& world, ReplicaPlace place,
                    const std::string& fingerprint, const std::string& join = "");
  ~ReplicaMembership();

  int64_t id() const { return id_; }
  // Round 0: waits for the first generation. A resumed replica brings where its checkpoint left
  // the stream, its steps and its outer steps; replicas resumed together continue where they left
  // it (in the order they register: launch them in their old order to resume exactly).
  RoundReport start(int64_t stream_rows, int64_t step, int64_t outer_steps);
  // A joiner's admission (diloco.join): waits, for as long as the service answers, for the outer
  // step that admits it, and makes its groups. Throws if the run ends first.
  RoundReport await_admission();
  // The current generation's replicate group for this rank's position (null with one member).
  Communicator* group() const { return group_.get(); }
  // A mixed generation's members' shard counts, in member order (their ranks' order in group());
  // empty when every member has this replica's.
  const std::vector<int64_t>& mixed_shards() const { return mixed_shards_; }
  // A round that admitted joiners: the group of its source's ranks and then its joiners' at this
  // rank's TP position (the source's first shard rank first), over which the joiners take their
  // state; null for the other members.
  std::unique_ptr<Communicator> transfer_group(const RoundReport& round);
  // Outer step `round` after step `step`, with `rows` the stream rows read by then. `exchange`
  // runs the exchange over the generation's replicate group (null with a single member) and
  // throws if it fails; it may run more than once (a retry over fewer members).
  // `last`: the run's final outer step (no joiner is let in there).
  RoundReport outer_round(int64_t round, int64_t step, int64_t stream_rows, bool last,
                          const std::function<void(Communicator*)>& exchange);
  // The replica trained its last step: the peers service stops waiting for it. Every rank calls it
  // (a barrier over the replica's ranks comes first).
  void finish();

 private:
  RoundReport round(int64_t round, int64_t step, int64_t stream_rows, bool last, int64_t outer_steps_done,
                    const std::function<void(Communicator*)>* exchange);
  // Waits for `key` (within a few service timeouts when `bounded`), the replica's watchdog stood
  // down meanwhile and set to `phase` after.
  std::string wait_for(const std::string& key, const std::string& phase, const std::string& what, bool bounded = true);
  void make_groups(const Quorum& q, int64_t index);
  int64_t shards_of(int64_t id);  // a replica's shard count, read once from the store
  // A Gloo group of `size` replicas' ranks at this rank's world position, this one `rank` of them,
  // meeting under `prefix` of the peers' store. Gloo (through host memory for a GPU's tensors):
  // NCCL would abort the process on a lost peer. Its collectives fail after runtime.timeout_s by
  // themselves (a dead member's closed connection sooner).
  std::unique_ptr<Communicator> group_over(const std::string& prefix, int64_t rank, int64_t size);
  void connect_liveness(const std::string& host);
  // Ends the heartbeat and closes the liveness connection (the destructor; a constructor that throws).
  void stop_heartbeat();

  Communicator& world_;
  ReplicaPlace place_;
  std::string where_;  // host:port
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  int64_t id_ = -1;
  bool leader_ = false;
  std::string join_;
  int64_t generation_ = 0;        // the latest membership this replica knows
  int64_t group_generation_ = 0;  // the one group_ was made for
  int64_t broken_generation_ = -1;  // one whose groups failed at their making: its rounds fail
  std::unique_ptr<Communicator> group_;  // the replicate group of this position in the world
  std::vector<int64_t> mixed_shards_;    // its members' shard counts, when they differ
  std::map<int64_t, int64_t> shards_;    // replica id -> shard count
  int liveness_fd_ = -1;  // the leader's connection to the service: closed when its process ends
  std::atomic<bool> stopping_{false};
  std::thread heartbeat_;
};

}  // namespace zb
