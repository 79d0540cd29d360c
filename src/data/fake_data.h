#pragma once
// ZeroBand's fake data: documents of random length U[1, seq_len] with tokens uniform in
// [3, 1024) (clipped to the vocabulary), each followed by EOS (id 1), packed back to back into
// rows of seq_len + 1 tokens. Row i is generated from (seed, i) alone, so any rank can produce any
// row and every world size sees the same global batches.
#include <cstdint>

#include "data/loader.h"

namespace zb {

class FakeDataset : public SampleSource {
 public:
  static constexpr int64_t kEos = 1;
  static constexpr int64_t kFirstToken = 3;

  FakeDataset(uint64_t seed, int64_t seq_len, int64_t vocab_size);
  int64_t num_samples() const override { return -1; }  // endless
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t index, int64_t* row) const override;

 private:
  uint64_t seed_;
  int64_t seq_len_, vocab_size_;
};

}  // namespace zb
