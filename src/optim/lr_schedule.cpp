#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace zb {

double LrSchedule::multiplier(int64_t step) const {
  const double s = static_cast<double>(step);
  if (step < warmup_steps) return s / static_cast<double>(warmup_steps);
  double m = 1.0;
  if (type == "cosine") {
    const double span = std::max<double>(1.0, static_cast<double>(total_steps - warmup_steps));
    const double p = std::min(1.0, (s - warmup_steps) / span);
    m = 0.5 * (1.0 + std::cos(M_PI * p));
  } else if (type == "linear") {
    const double span = std::max<double>(1.0, static_cast<double>(total_steps - warmup_steps));
    m = (static_cast<double>(total_steps) - s) / span;
  } else if (type == "wsd-sqrt") {
    if (step < stable_steps) return 1.0;
    const double span = std::max<double>(1.0, static_cast<double>(total_steps - stable_steps));
    m = 1.0 - std::sqrt((s - stable_steps) / span);
  }
  return std::max(0.0, m);
}

}  // namespace zb
