#pragma once
// What one training step does, event by event: the engines' gathers, frees, block computations
// and gradient hand-offs, and every collective of the step with its group and bytes. The same
// type serves twice: the step plan (plan/step_plan.h) lists the events a step will make, and a
// StepTrace attached to a run records the events it made (cheaply: one small struct per event,
// nothing when no trace is attached). Tests check that the two agree.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dist/comm.h"

namespace zb {

struct StepEvent {
  enum class Op {
    MicroBatch,  // a micro-batch starts (`micro_batch`)
    Unshard,     // a unit's parameters are gathered and in place (after its all-gather, if any)
    Forward,     // a block's forward starts
    Loss,        // the head and the loss (the last of forward; backward follows)
    Recompute,   // activation checkpointing: a block's forward again, in its backward
    Reshard,     // a unit's gathered parameters are freed (in backward: its gradients are computed)
    Backward,    // a unit's post-backward is done: its gradients summed or handed to a collective
    Collective,  // a collective is issued (kind, group, ranks, bytes)
    Optimizer,   // the gradients are final: clipping and the optimizer follow
  };
  Op op = Op::Collective;
  int64_t unit = -1;         // a block's index; the root (embedding, final norm, head) is n_layers
  int64_t micro_batch = -1;  // MicroBatch's number, from 0
  CommKind kind = CommKind::Count;
  std::string group;  // "world", "shard" or "replicate": which of the run's communicators
  int64_t ranks = 0;
  int64_t payload = 0;  // bytes as comm_bytes.h names them for the call (all_to_all: its input)
  int64_t counted = 0;  // bytes the statistics count for it (comm_bytes.h's convention)
  // Notes of the plan's, neither traced nor compared: what the event is for, and what a
  // collective can hide behind in the step ("gather", "regather", "reduce" or "exposed").
  std::string what, overlap;

  // One line with everything a trace and a plan must agree on.
  std::string describe() const;

  static StepEvent mark(Op op, int64_t unit = -1);
  static StepEvent micro_batch_start(int64_t micro_batch);
  static StepEvent collective(CommKind kind, std::string group, int64_t ranks, int64_t payload, int64_t counted);
};
const char* step_op_name(StepEvent::Op op);

class StepTrace : public CollectiveObserver {
 public:
  void record(StepEvent event) { events_.push_back(std::move(event)); }
  void record(StepEvent::Op op, int64_t unit) { record(StepEvent::mark(op, unit)); }
  void collective(CommKind kind, const std::string& group, int64_t ranks, int64_t payload,
                  int64_t counted) override;
  const std::vector<StepEvent>& events() const { return events_; }
  void clear() { events_.clear(); }

  // While one lives, the collectives recorded are the unit's (an FSDP unit's gathers and
  // reductions); nested, the inner one's, then the outer one's again.
  class UnitScope {
   public:
    UnitScope(StepTrace* trace, int64_t unit) : trace_(trace) {
      if (trace_) previous_ = std::exchange(trace_->unit_, unit);
    }
    ~UnitScope() {
      if (trace_) trace_->unit_ = previous_;
    }
    UnitScope(const UnitScope&) = delete;
    UnitScope& operator=(const UnitScope&) = delete;

   private:
    StepTrace* trace_;
    int64_t previous_ = -1;
  };

 private:
  std::vector<StepEvent> events_;
  int64_t unit_ = -1;  // whose collectives are being issued (UnitScope)
};

}  // namespace zb
