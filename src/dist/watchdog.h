#pragma once
// A bound on how long a rank may wait on the others. Gloo's collectives time out by themselves,
// but NCCL's wait() only orders streams: with a dead or hung peer the host blocks in the step's
// next device-to-host copy until NCCL's own watchdog kills the process, without saying which step
// stalled. This thread watches the time since the last sign of progress (a collective completed,
// a new phase begun) while a phase of the run is set; past the limit it logs which phase stalled,
// calls on_stall (the communicator aborts its backend, which releases kernels waiting on dead
// peers) and exits the process with code 1. The backends' own timeouts are set longer
// (Communicator), so this message comes first.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace zb {

class Watchdog {
 public:
  Watchdog(std::chrono::milliseconds limit, int64_t rank, std::function<void()> on_stall);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Watch `phase` ("step 12"), from now; "" stops watching.
  void set_phase(const std::string& phase);
  // Something finished that needed the other ranks: the clock starts again.
  void progress();

 private:
  void run();

  const std::chrono::milliseconds limit_;
  const int64_t rank_;
  const std::function<void()> on_stall_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::string phase_;
  std::chrono::steady_clock::time_point last_progress_;
  bool closing_ = false;
  std::thread thread_;  // last: started once the rest is set
};

}  // namespace zb
