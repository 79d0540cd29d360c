#include "dist/comm_bytes.h"

#include <stdexcept>
#include <string>

namespace zb {

const char* comm_kind_name(CommKind kind) {
  switch (kind) {
    case CommKind::AllGather: return "all_gather";
    case CommKind::ReduceScatter: return "reduce_scatter";
    case CommKind::AllReduce: return "all_reduce";
    case CommKind::Broadcast: return "broadcast";
    case CommKind::AllToAll: return "all_to_all";
    case CommKind::Count: break;
  }
  return "?";
}

int64_t ring_counted_bytes(CommKind kind, int64_t ranks, int64_t payload) {
  switch (kind) {
    case CommKind::AllGather:
    case CommKind::ReduceScatter: return 2 * (ranks - 1) * payload;
    // Multiplied out before dividing, so an uneven split is the exact mean, rounded down once.
    case CommKind::AllReduce: return 4 * (ranks - 1) * payload / ranks;
    default: break;
  }
  throw std::invalid_argument(std::string("ring_counted_bytes: not a ring collective: ") + comm_kind_name(kind));
}

int64_t broadcast_counted_bytes(int64_t ranks, int64_t rank, int64_t root, int64_t payload) {
  // A chain root -> root+1 -> ... -> root-1: the root sends, the last rank receives, the ranks
  // between do both.
  if (ranks == 1) return 0;
  const bool last = rank == (root + ranks - 1) % ranks;
  return rank == root || last ? payload : 2 * payload;
}

int64_t rooted_counted_bytes(int64_t ranks, int64_t rank, int64_t root, int64_t payload) {
  if (ranks == 1) return 0;
  return rank == root ? (ranks - 1) * payload : payload;
}

int64_t all_to_all_counted_bytes(int64_t ranks, int64_t rank, int64_t unit_bytes, int64_t in_units,
                                 int64_t out_units, const std::vector<int64_t>& in_splits,
                                 const std::vector<int64_t>& out_splits) {
  // What goes to the other ranks and comes from them; this rank's own part stays.
  auto to_others = [&](const std::vector<int64_t>& splits, int64_t units) {
    if (splits.empty()) return units / ranks * (ranks - 1);
    int64_t n = 0;
    for (int64_t r = 0; r < ranks; ++r)
      if (r != rank) n += splits.at(static_cast<size_t>(r));
    return n;
  };
  return unit_bytes * (to_others(in_splits, in_units) + to_others(out_splits, out_units));
}

}  // namespace zb

int64_t zb_counted_bytes(const char* kind, int64_t ranks, int64_t rank, int64_t root, int64_t payload) {
  using namespace zb;
  const std::string k = kind;
  if (k == "all_gather") return ring_counted_bytes(CommKind::AllGather, ranks, payload);
  if (k == "reduce_scatter") return ring_counted_bytes(CommKind::ReduceScatter, ranks, payload);
  if (k == "all_reduce") return ring_counted_bytes(CommKind::AllReduce, ranks, payload);
  if (k == "broadcast") return broadcast_counted_bytes(ranks, rank, root, payload);
  if (k == "gather" || k == "scatter") return rooted_counted_bytes(ranks, rank, root, payload);
  return -1;
}

int64_t zb_all_to_all_counted_bytes(int64_t ranks, int64_t rank, int64_t unit_bytes, int64_t in_units,
                                    int64_t out_units, const int64_t* in_splits, const int64_t* out_splits) {
  const std::vector<int64_t> in = in_splits ? std::vector<int64_t>(in_splits, in_splits + ranks) : std::vector<int64_t>{};
  const std::vector<int64_t> out =
      out_splits ? std::vector<int64_t>(out_splits, out_splits + ranks) : std::vector<int64_t>{};
  return zb::all_to_all_counted_bytes(ranks, rank, unit_bytes, in_units, out_units, in, out);
}
