#pragma once
// What a part of a run keeps in its checkpoints (checkpoint/checkpoint.h), as the part itself
// says: its tensors as this rank holds them, and a few numbers in the checkpoint's meta.json
// under the part's own name. The parts implement Stateful (the data loader, DiLoCo, the
// parameters with their optimizer state); a checkpoint walks a list of them and knows nothing
// else of them. It sits at the bottom of the layers so that any part can.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace zb {

// One tensor of the training state as this rank holds it.
struct StateTensor {
  std::string name;                   // "model/<param>", "optim/<param>.<key>", "diloco/..."
  at::Tensor local;                   // rows [row_start, row_start + local.size(0)) of the whole
  std::vector<int64_t> global_shape;  // empty: a scalar (AdamW's step), the same on every rank
  int64_t row_start = 0;
  bool replicated = false;            // every rank holds the same rows
  // Each replica holds its own value under its own name (DiLoCo's inner state, "replica_<r>/..."):
  // every replica writes it. Otherwise one copy is written, the first replica's.
  bool per_replica = false;
  // Tensor parallelism (ShardedParameter): the rows' first column in the whole (a block of
  // columns when local.size(1) is less than the whole's), and whether every rank of the TP group
  // holds the same rows (TP rank 0 writes them).
  int64_t col_start = 0;
  bool tp_shared = false;
};

// A part's numbers in meta.json, under its name: {"stream_rows": 1536, "batch_size": 64, ...}.
using StateRecord = std::map<std::string, int64_t>;

// The value of `key` in a saved record; an error naming both when a damaged one lacks it.
inline int64_t record_value(const StateRecord& record, const std::string& name, const std::string& key) {
  const auto it = record.find(key);
  if (it == record.end()) throw std::runtime_error("meta.json's \"" + name + "\" has no " + key + " (damaged?)");
  return it->second;
}

// Where a resume continues: after `step` steps of a run seeded with `seed`, and what the part
// recorded there (none in a checkpoint saved without it, or older than the record).
struct RestorePoint {
  int64_t step = 0;
  uint64_t seed = 0;
  std::optional<StateRecord> record;
};

class Stateful {
 public:
  virtual ~Stateful() = default;
  // The name of its record in meta.json ("" keeps none) and the record, saved by the first rank.
  virtual std::string record_name() const { return ""; }
  virtual StateRecord record() const { return {}; }
  // Its tensors (names unique over the run). A resume copies the saved values into them.
  virtual std::vector<StateTensor> tensors() { return {}; }
  // A resume, over all parts in their order: prepare_restore (what tensors() returns may depend
  // on the step), then the tensors are loaded, then restore.
  virtual void prepare_restore(const RestorePoint& /*at*/) {}
  virtual void restore(const RestorePoint& /*at*/) {}
};

}  // namespace zb
