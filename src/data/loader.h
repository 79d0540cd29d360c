#pragma once
// Samples, their order and their split over ranks.
//
// A SampleSource gives numbered samples of seq_len + 1 tokens (inputs = row[:-1],
// targets = row[1:]). The DataLoader walks a global order of them: global batch s is positions
// [s*B, (s+1)*B) of that order, and rank r of W reads positions [r*B/W, (r+1)*B/W) of each, so
// the global batch does not depend on the world size. For a finite source the order is a
// permutation of its samples drawn from (seed, epoch) (or the plain order without shuffling),
// epoch after epoch. The loader's whole state is how many rows this rank has consumed.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace zb {

struct Batch {
  at::Tensor inputs;   // [micro_bs, seq_len] int64
  at::Tensor targets;  // [micro_bs, seq_len] int64
};

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t num_samples() const = 0;  // -1: endless
  virtual int64_t seq_len() const = 0;
  // Fills row (seq_len + 1 tokens) with sample `index` (0 <= index < num_samples()).
  virtual void sample(int64_t index, int64_t* row) const = 0;
};

struct LoaderState {
  int64_t rows_consumed = 0;  // by this rank
  uint64_t seed = 0;
  int64_t world_size = 1;
};

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const SampleSource> source, uint64_t seed, bool shuffle,
             int64_t global_batch, int64_t micro_bs, int64_t rank, int64_t world_size);

  // The next micro-batch of this rank (CPU tensors).
  Batch next();
  // The global position of this rank's next row, and the sample it maps to.
  int64_t next_position() const;
  int64_t sample_at(int64_t position) const;

  LoaderState state() const { return {rows_, seed_, world_}; }
  // Resumes at the next unseen row. Throws if the state came from another seed or world size.
  void load_state(const LoaderState& state);

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;

  std::shared_ptr<const SampleSource> source_;
  uint64_t seed_;
  bool shuffle_;
  int64_t global_batch_, micro_bs_, rank_, world_;
  int64_t rows_ = 0;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_permutation_;
};

}  // namespace zb
