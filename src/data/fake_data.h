#pragma once
// ZeroBand's fake data: documents of random length U[1, seq_len] with tokens uniform in
// [3, 1024) (clipped to the vocabulary), each followed by EOS (id 1), packed back to back into
// rows of seq_len + 1 tokens (inputs = row[:-1], targets = row[1:]).
//
// Each row is generated from (seed, its global sample index) alone, so the global batch of a step
// is the same however many ranks share it: rank r of W reads rows
// [r*B/W, (r+1)*B/W) of every global batch of B rows.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zb {

struct Batch {
  at::Tensor inputs;   // [micro_bs, seq_len] int64
  at::Tensor targets;  // [micro_bs, seq_len] int64
};

class FakeDataset {
 public:
  static constexpr int64_t kEos = 1;
  static constexpr int64_t kFirstToken = 3;

  FakeDataset(uint64_t seed, int64_t seq_len, int64_t vocab_size, int64_t global_batch,
              int64_t micro_bs, int64_t rank, int64_t world_size);

  // The next micro-batch for this rank (on the CPU).
  Batch next();
  // Fills `row` (seq_len + 1 tokens) with global sample `index`.
  void sample(int64_t index, int64_t* row) const;

  int64_t samples_consumed() const { return cursor_; }

 private:
  uint64_t seed_;
  int64_t seq_len_, vocab_size_, global_batch_, micro_bs_, rank_, world_size_;
  int64_t cursor_ = 0;  // rows of this rank consumed so far
};

}  // namespace zb
