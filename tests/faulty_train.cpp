// train_fsdp (or train_ddp, with ZB_TEST_PARALLELISM=ddp) with faults put in, for the end-to-end
// tests of runs that go wrong (tests/e2e; conftest.py runs this program for any ZB_TEST_*). The
// faults are this program's: the training programs read none of these variables.
//   ZB_TEST_NONFINITE_GRAD_STEPS=3,4  at those steps (counted from the process's start) the last rank
//       finds a NaN in its reduced gradients, so that only the gradient norm's all-reduce tells the
//       others (a wrapper around the engine);
//   ZB_TEST_STOP_AFTER_STEP=n, ZB_TEST_KILL_AFTER_STEP=n  rank 0 stops (SIGSTOP: a machine frozen)
//       or dies (SIGKILL) after step n, its saves finished first so that it can be restarted;
//   ZB_TEST_PAUSE_SAVE_AT_STEP=n  every rank's writer of step n's save stops for good after its
//       data file, so that a test can kill the run inside a save;
//   ZB_TEST_HANG_IN_OUTER_STEP=n  DiLoCo: the last replica's first rank freezes at the start of outer
//       step n (its checkpoint writer goes on);
//   at elastic DiLoCo's exchange of outer step n: ZB_TEST_LATE_TO_EXCHANGE=n, the replica's ranks come
//       2 s late (a slow pack of a large model); ZB_TEST_KILL_IN_EXCHANGE=n, ZB_TEST_STOP_IN_EXCHANGE=n,
//       its first rank dies or freezes inside it, its group made; ZB_TEST_KILL_AFTER_EXCHANGE=n, it
//       dies after it, before its result is reported; ZB_TEST_FAIL_EXCHANGE=n, every rank fails
//       after it, at every attempt (an error that repeats).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dist/world.h"
#include "util/fault_points.h"
#include "util/log.h"
#include "training_program.h"

namespace {

// The engine with a fault: before clipping (once a step, after the gradients are reduced), at the
// steps listed, a NaN in this rank's first non-empty gradient. Everything else is the engine's.
class PoisonedEngine : public zb::ParallelModel {
 public:
  PoisonedEngine(std::unique_ptr<zb::ParallelModel> inner, std::vector<int64_t> steps)
      : inner_(std::move(inner)), steps_(std::move(steps)) {}
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const zb::Documents& documents) override {
    return inner_->loss(tokens, targets, documents);
  }
  void set_requires_gradient_sync(bool sync) override { inner_->set_requires_gradient_sync(sync); }
  void finish_backward() override { inner_->finish_backward(); }
  void reshard() override { inner_->reshard(); }
  void parameters_changed() override { inner_->parameters_changed(); }
  bool keeps_unsharded() const override { return inner_->keeps_unsharded(); }
  std::vector<zb::ShardedParameter> parameters() override { return inner_->parameters(); }
  at::Tensor clip_grad_norm_(double max_norm) override {
    if (std::find(steps_.begin(), steps_.end(), ++step_) != steps_.end())
      for (const zb::ShardedParameter& p : inner_->parameters())
        if (p.tensor->grad().defined() && p.tensor->numel() > 0) {
          p.tensor->mutable_grad().view(-1).narrow(0, 0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
          break;
        }
    return inner_->clip_grad_norm_(max_norm);
  }
  std::vector<std::pair<std::string, at::Tensor>> gather_full_parameters() override {
    return inner_->gather_full_parameters();
  }
  int64_t replica() const override { return inner_->replica(); }
  int64_t tp_rank() const override { return inner_->tp_rank(); }
  void set_trace(zb::StepTrace* trace) override { inner_->set_trace(trace); }

 private:
  std::unique_ptr<zb::ParallelModel> inner_;
  std::vector<int64_t> steps_;
  int64_t step_ = 0;  // clip_grad_norm_ runs once a step (Trainer::train_step)
};

// Whether the variable is set to `n`.
bool asked(const char* variable, int64_t n) {
  const char* at = std::getenv(variable);
  return at && std::to_string(n) == at;
}

int pid() { return static_cast<int>(::getpid()); }

void stop_or_kill(int signal, const std::string& where, const char* variable) {
  zb::log::warn(zb::strf("process %d %s %s (%s)", pid(), signal == SIGKILL ? "dies" : "stops",
                         where.c_str(), variable));
  std::raise(signal);
}

void freeze(const std::string& why) {
  zb::log::warn(why);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// The faults the ZB_TEST_* variables ask for, at the run's fault points (util/fault_points.h).
void put_faults(const zb::FaultSite& site) {
  using zb::FaultPoint;
  using zb::strf;
  const int64_t n = site.n;
  switch (site.point) {
    case FaultPoint::AfterStep:
      for (const auto& [variable, signal] : {std::pair{"ZB_TEST_STOP_AFTER_STEP", SIGSTOP},
                                             std::pair{"ZB_TEST_KILL_AFTER_STEP", SIGKILL}})
        if (site.chosen && asked(variable, n)) {
          site.finish_saves();
          stop_or_kill(signal, strf("after step %ld", n), variable);
        }
      break;
    case FaultPoint::InSave:
      if (asked("ZB_TEST_PAUSE_SAVE_AT_STEP", n))
        freeze(strf("checkpoint: writer paused inside the save of step %ld (ZB_TEST_PAUSE_SAVE_AT_STEP)", n));
      break;
    case FaultPoint::OuterStep:
      if (site.chosen && asked("ZB_TEST_HANG_IN_OUTER_STEP", n))
        freeze(strf("outer step %ld: process %d stops here (ZB_TEST_HANG_IN_OUTER_STEP)", n, pid()));
      break;
    case FaultPoint::ExchangeStart:
      if (asked("ZB_TEST_LATE_TO_EXCHANGE", n)) {
        zb::log::warn(strf("outer step %ld: 2 s late to the exchange (ZB_TEST_LATE_TO_EXCHANGE)", n));
        std::this_thread::sleep_for(std::chrono::seconds(2));
      }
      for (const auto& [variable, signal] : {std::pair{"ZB_TEST_KILL_IN_EXCHANGE", SIGKILL},
                                             std::pair{"ZB_TEST_STOP_IN_EXCHANGE", SIGSTOP}})
        if (site.chosen && asked(variable, n)) stop_or_kill(signal, strf("in outer step %ld's exchange", n), variable);
      break;
    case FaultPoint::ExchangeDone:
      if (asked("ZB_TEST_FAIL_EXCHANGE", n))
        throw std::runtime_error(strf("outer step %ld: a failure for tests (ZB_TEST_FAIL_EXCHANGE)", n));
      if (site.chosen && asked("ZB_TEST_KILL_AFTER_EXCHANGE", n)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the peers' last bytes leave first
        stop_or_kill(SIGKILL, strf("after outer step %ld's exchange", n), "ZB_TEST_KILL_AFTER_EXCHANGE");
      }
      break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  zb::install_fault_hook(put_faults);
  std::vector<int64_t> steps;
  if (const char* list = std::getenv("ZB_TEST_NONFINITE_GRAD_STEPS")) {
    std::stringstream in(list);
    for (std::string item; std::getline(in, item, ',');) steps.push_back(std::stoll(item));
  }
  const char* parallelism = std::getenv("ZB_TEST_PARALLELISM");
  const bool ddp = parallelism && std::string(parallelism) == "ddp";
  const zb::World world = zb::detect_world();
  const bool last_rank = world.rank == world.size - 1;
  auto poison = [steps, last_rank](zb::TrainingParts& parts) {
    if (last_rank && !steps.empty()) parts.engine = std::make_unique<PoisonedEngine>(std::move(parts.engine), steps);
  };
  return zb::training_main(argc, argv, ddp ? zb::EngineKind::Replicated : zb::EngineKind::Sharded, "train_fsdp",
                           /*over_nodes=*/false, poison);
}
