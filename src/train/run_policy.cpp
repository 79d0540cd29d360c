#include "train/run_policy.h"

#include <cmath>

#include "util/log.h"

namespace zb {

MemoryVerdict judge_memory(const Config& c, int64_t world_size, const c10::Device& device, const MemoryBudget& budget) {
  const at::ScalarType compute = Trainer::resolve_compute_dtype(c, device);
  const std::string& setting = c.train.reduce_every_micro_batch;
  MemoryVerdict v;
  v.estimate = estimate_step_memory(c, world_size, compute, device.is_cuda(), setting == "true");
  const bool known = budget.device_bytes > 0;
  if (setting == "auto" && known && v.estimate.peak > budget.usable) {
    MemoryEstimate sharded = estimate_step_memory(c, world_size, compute, device.is_cuda(), true);
    if (sharded.reduce_every_micro_batch && sharded.peak <= budget.usable) {
      v.estimate = sharded;
      v.auto_turned_on = true;
    }
  }
  v.reduce_every_micro_batch = v.estimate.reduce_every_micro_batch;
  v.fits = !known || v.estimate.peak <= budget.usable;
  v.table = describe_memory(v.estimate, budget);
  return v;
}

NonfiniteDecision decide_nonfinite(const StepStats& s, const Config& c, const std::string& last_good) {
  auto number = [](double v) { return std::isnan(v) ? std::string("nan") : strf("%g", v); };
  const std::string what = strf("step %ld: the %s is not finite (loss %s, gradient norm %s), the step was not applied",
                                s.step, s.nonfinite.c_str(), number(s.loss).c_str(), number(s.grad_norm).c_str());
  const bool skip = c.train.nonfinite == "skip";
  if (skip && s.skipped_in_a_row < c.train.max_skipped_steps)
    return {false, strf("%s: skipped (%ld in a row, %ld in all; train.max_skipped_steps = %ld in a row stops the run)",
                        what.c_str(), s.skipped_in_a_row, s.skipped_total, c.train.max_skipped_steps)};
  return {true, what +
                    (skip ? strf("; %ld such steps in a row (train.max_skipped_steps)", s.skipped_in_a_row)
                          : std::string("; stopping (train.nonfinite = \"stop\")")) +
                    "; nothing saved; the last good checkpoint is " +
                    (last_good.empty() ? "none (no checkpoint yet)" : last_good)};
}

}  // namespace zb
