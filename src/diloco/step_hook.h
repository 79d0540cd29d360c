#pragma once
// DiLoCo around the Trainer's steps (train/trainer.h), which knows it only through this hook:
//   before the first step  the outer copies take the parameters (unless a checkpoint or a joiner's
//                          source set them); elastic replicas form their first generation (round 0);
//   after each step        the outer steps due then; under elastic replicas the joiners admitted
//                          take their state from the round's source, and this replica's rows of
//                          the run's stream follow its membership;
//   a joiner's start       (diloco.join) it waits for the running run's next outer step and takes
//                          the run's state there;
//   checkpoints            it keeps DiLoCo's tensors and its record "diloco" (util/stateful.h).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/state.h"
#include "diloco/diloco.h"
#include "util/stateful.h"

namespace zb {

class DataLoader;
class Optimizer;

// What DiLoCo did after a step, for the step's record.
struct DiLoCoStepReport {
  std::optional<OuterSyncStats> outer;   // the outer steps taken, if any
  std::optional<RoundReport> membership; // elastic: this replica's membership, when new
};

class DiLoCoHook : public Stateful {
 public:
  // Over the run's parts, which outlive it: DiLoCo's outer optimizer, the engine holding the
  // parameters, the optimizer and the data loader (a joiner takes their state), and the replica's
  // world (its phase for the watchdog).
  DiLoCoHook(DiLoCo& diloco, ParallelModel& engine, Optimizer& optimizer, DataLoader& data, Communicator& world,
             int64_t total_steps);

  // Before step `counters.step` (1-based) runs.
  void before_step(const StepCounters& counters);
  // After its optimizer, the gradients freed (their memory holds DiLoCo's temporaries).
  DiLoCoStepReport after_step(StepCounters& counters);
  // A joiner: waits for the outer step that admits it and takes the run's state and counters.
  void join_run(StepCounters& counters);
  // Checkpoints: the outer copies, their momentum and the exchanges in flight (DiLoCo::state), and
  // the record {inner_steps, replicas; for elastic replicas stream_rows, the run's data stream
  // read by then}. A resume makes room for the exchanges in flight at its step, and picks the
  // schedule up there (an elastic replica's round 0 continues from the saved stream row).
  std::string record_name() const override { return "diloco"; }
  StateRecord record() const override;
  std::vector<StateTensor> tensors() override { return diloco_.state(); }
  void prepare_restore(const RestorePoint& at) override { diloco_.prepare_restore(at.step, total_steps_); }
  void restore(const RestorePoint& at) override;

 private:
  // This replica's rows of the run's stream follow its new membership.
  const RoundReport& follow(const RoundReport& round);
  // A round that admitted joiners: the round's source sends and the joiners take the counters,
  // DiLoCo's outer copies (the parameters equal them then) and momentum, and the optimizer state
  // when round.with_optimizer; the other members take no part. Returns the bytes this rank took.
  int64_t share_state(const RoundReport& round, StepCounters& counters);

  DiLoCo& diloco_;
  ParallelModel& engine_;
  Optimizer& optimizer_;
  DataLoader& data_;
  Communicator& world_;
  int64_t total_steps_;
  bool outer_set_ = false;     // the outer copies hold the run's state (first step, checkpoint, source)
  bool in_membership_ = false; // elastic: round 0 done, or admitted as a joiner
  int64_t resumed_stream_rows_ = 0;
  std::optional<RoundReport> new_membership_;  // for the next step's record
};

}  // namespace zb
