#pragma once
// Places in a run where a test program puts a fault, as a machine lost mid-run would leave the
// other ranks: a rank stopped or killed after a step, a checkpoint save frozen halfway, a DiLoCo
// replica frozen in its outer step, late to an exchange, lost in or after it, or failing it. The
// training programs install nothing and read no variable for it: the faults are the test
// program's (tests/faulty_train.cpp), which installs a hook before the run starts.
#include <cstdint>
#include <functional>

namespace zb {

enum class FaultPoint {
  AfterStep,      // the loop, step n's metrics logged, before its save
  InSave,         // the checkpoint writer of step n's save, its data file written, its index not
  OuterStep,      // DiLoCo, the start of outer step n
  ExchangeStart,  // elastic DiLoCo, outer step n's exchange: its group made, nothing sent
  ExchangeDone,   // ... and after it, before its result is reported to the peers service
};

struct FaultSite {
  FaultPoint point;
  int64_t n;  // the step, or the outer step
  // Whether this process is the one a fault of a single process takes here: rank 0 of the world
  // (AfterStep), of the replica (the exchanges), the last replica's first rank (OuterStep); every
  // rank's writer (InSave).
  bool chosen;
  // AfterStep: waits for the checkpoint save in flight, so that a rank stopped or killed here can
  // be restarted from it.
  std::function<void()> finish_saves;
};

using FaultHook = std::function<void(const FaultSite&)>;
// For the whole process, before the run starts (the checkpoint writer's thread reads it).
void install_fault_hook(FaultHook hook);
// The installed hook at `site`; nothing without one.
void fault_point(const FaultSite& site);

}  // namespace zb
