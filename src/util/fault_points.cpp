#include "util/fault_points.h"

#include <utility>

namespace zb {

namespace {
FaultHook& installed() {
  static FaultHook hook;
  return hook;
}
}  // namespace

void install_fault_hook(FaultHook hook) { installed() = std::move(hook); }

void fault_point(const FaultSite& site) {
  if (const FaultHook& hook = installed()) hook(site);
}

}  // namespace zb
