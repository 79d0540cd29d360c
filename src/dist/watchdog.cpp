#include "dist/watchdog.h"

#include <cstdlib>

#include "util/log.h"

namespace zb {

Watchdog::Watchdog(std::chrono::milliseconds limit, int64_t rank, std::function<void()> on_stall)
    : limit_(limit), rank_(rank), on_stall_(std::move(on_stall)), thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::set_phase(const std::string& phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ = phase;
  last_progress_ = std::chrono::steady_clock::now();
}

void Watchdog::progress() {
  std::lock_guard<std::mutex> lock(mutex_);
  last_progress_ = std::chrono::steady_clock::now();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  // Checked once a second (a stopped process, SIGSTOP, finds its limit passed when it resumes).
  while (!wake_.wait_for(lock, std::chrono::seconds(1), [this] { return closing_; })) {
    if (phase_.empty()) continue;
    const auto waited = std::chrono::steady_clock::now() - last_progress_;
    if (waited < limit_) continue;
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(waited).count();
    log::error(strf("rank %ld failed in %s: no collective with the other ranks completed for %ld s "
                    "(runtime.timeout_s = %ld): one of them may have died or hung (see its log); "
                    "aborting the collectives and exiting",
                    rank_, phase_.c_str(), static_cast<long>(seconds),
                    static_cast<long>(std::chrono::duration_cast<std::chrono::seconds>(limit_).count())));
    lock.unlock();
    on_stall_();
    log::flush();
    // The main thread is blocked inside the backend: no unwinding, no destructors.
    std::_Exit(1);
  }
}

}  // namespace zb
