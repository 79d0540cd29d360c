#include "data/fake_data.h"

#include <algorithm>
#include <random>

namespace zb {

FakeDataset::FakeDataset(uint64_t seed, int64_t seq_len, int64_t vocab_size)
    : seed_(seed), seq_len_(seq_len), vocab_size_(vocab_size) {}

void FakeDataset::sample(int64_t index, int64_t* row) const {
  std::seed_seq seq{seed_, static_cast<uint64_t>(index), uint64_t{0x5eed}};
  std::mt19937_64 rng(seq);
  std::uniform_int_distribution<int64_t> doc_len(1, seq_len_);
  std::uniform_int_distribution<int64_t> token(kFirstToken, std::min<int64_t>(1024, vocab_size_) - 1);
  int64_t n = 0, remaining = 0;
  while (n < seq_len_ + 1) {
    if (remaining == 0) remaining = doc_len(rng);
    row[n++] = token(rng);
    if (--remaining == 0 && n < seq_len_ + 1) row[n++] = kEos;
  }
}

}  // namespace zb
