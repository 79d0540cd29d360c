#pragma once
// Learning-rate multipliers (ZeroBand's schedules), applied to every group's base lr.
#include <cstdint>
#include <string>

namespace zb {

struct LrSchedule {
  std::string type = "cosine";  // cosine | linear | wsd-sqrt
  int64_t warmup_steps = 0;
  int64_t stable_steps = 0;  // wsd-sqrt only
  int64_t total_steps = 1;

  // Multiplier for optimizer step `step`, counted from 1. Warmup: step/warmup. Then
  //   cosine:   0.5*(1 + cos(pi*p)), p = (step-warmup)/(total-warmup)
  //   linear:   (total-step)/(total-warmup)
  //   wsd-sqrt: 1 until stable_steps, then 1 - sqrt((step-stable)/(total-stable))
  // clamped at 0. (ZeroBand evaluates the same formulas at step-1 and runs total+1 steps, so its
  // first step has lr 0; we run exactly total steps and the first one already learns.)
  double multiplier(int64_t step) const;
};

}  // namespace zb
