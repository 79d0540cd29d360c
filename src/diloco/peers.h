#pragma once
// The membership service of an elastic DiLoCo run (`diloco_peers`; diloco/membership.h has the
// replicas' side and the protocol). It serves the store the replicas meet at and decides each
// round alone, so that every replica reads the same answer:
//   - round 0 waits for `replicas` registrations; generation 1 is the first `replicas` ids;
//   - a round's quorum is the previous members that arrived at it, less the lost: one whose
//     connection to the service closed (died, seen at once) or whose heartbeat has not moved for
//     `timeout` (hung);
//   - a round's decision is "commit" when every quorum member that reported succeeded, else
//     "retry" with those that reported, as a new generation; the fifth failed attempt at one
//     round stops the run, naming it.
// It ends when every member has finished, or when none is left.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace zb {

struct PeersOptions {
  int64_t port = 29600;
  int64_t replicas = 1;                 // registrations round 0 waits for
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  // a heartbeat older than this: lost
};

// Serves and decides until the run ends; returns the process's exit code (0: every member
// finished; 1: none left, or a round that kept failing). `say` receives each line worth logging.
int serve_peers(const PeersOptions& options, const std::function<void(const std::string&)>& say);

}  // namespace zb
