#include "dist/placement.h"

#include <algorithm>
#include <stdexcept>

#include "util/device.h"

namespace zb {

int64_t Placement::sharing(int64_t r) const {
  const RankPlace& p = ranks.at(static_cast<size_t>(r));
  if (p.device == "cpu") return 1;
  return std::count_if(ranks.begin(), ranks.end(),
                       [&](const RankPlace& q) { return q.host == p.host && q.device == p.device; });
}

int64_t Placement::most_sharing() const {
  int64_t most = 1;
  for (size_t r = 0; r < ranks.size(); ++r) most = std::max(most, sharing(static_cast<int64_t>(r)));
  return most;
}

Placement exchange_placement(const Rendezvous& rendezvous, const c10::Device& device) {
  const std::string mine = host_name() + "\t" + (device.is_cuda() ? device_pci_bus_id(device) : "cpu");
  Placement p;
  p.rank = rendezvous.world().rank;
  for (const std::string& s : rendezvous.exchange("device_place", mine)) {
    const auto tab = s.find('\t');
    p.ranks.push_back({s.substr(0, tab), s.substr(tab + 1)});
  }
  return p;
}

BackendChoice choose_backend(const std::string& requested, const c10::Device& device, const Placement& placement) {
  if (!device.is_cuda()) {
    if (requested == "nccl")
      throw std::invalid_argument("runtime.backend = \"nccl\" carries GPU tensors, but this run is on the CPU "
                                  "(runtime.backend = \"auto\" or \"gloo\")");
    return {Transport::Gloo, ""};
  }
  // The first GPU with more than one rank, for the messages.
  std::string shared;
  for (size_t r = 0; r < placement.ranks.size() && shared.empty(); ++r)
    if (placement.sharing(static_cast<int64_t>(r)) > 1)
      shared = std::to_string(placement.sharing(static_cast<int64_t>(r))) + " ranks share the GPU " +
               placement.ranks[r].device + " on " + placement.ranks[r].host;
  if (requested == "gloo")
    return {Transport::GlooThroughHost, "runtime.backend = \"gloo\": through host memory"};
  if (requested == "nccl") {
    if (!shared.empty())
      throw std::invalid_argument("runtime.backend = \"nccl\": NCCL takes one rank per GPU, but " + shared +
                                  " (runtime.backend = \"auto\" or \"gloo\" runs them over Gloo)");
    return {Transport::Nccl, ""};
  }
  if (!shared.empty())
    return {Transport::GlooThroughHost,
            "runtime.backend = \"auto\": " + shared +
                ", which NCCL refuses: Gloo through host memory (slow; for debugging layouts, not for speed)"};
  return {Transport::Nccl, ""};
}

}  // namespace zb
