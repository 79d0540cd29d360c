#include "data/fake_data.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <random>

namespace zb {

FakeDataset::FakeDataset(uint64_t seed, int64_t seq_len, int64_t vocab_size, int64_t global_batch,
                         int64_t micro_bs, int64_t rank, int64_t world_size)
    : seed_(seed), seq_len_(seq_len), vocab_size_(vocab_size), global_batch_(global_batch),
      micro_bs_(micro_bs), rank_(rank), world_size_(world_size) {}

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

Batch FakeDataset::next() {
  const int64_t per_rank = global_batch_ / world_size_;
  at::Tensor rows = at::empty({micro_bs_, seq_len_ + 1}, at::kLong);
  int64_t* data = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < micro_bs_; ++j, ++cursor_) {
    const int64_t step = cursor_ / per_rank, within = cursor_ % per_rank;
    sample(step * global_batch_ + rank_ * per_rank + within, data + j * (seq_len_ + 1));
  }
  return {rows.slice(1, 0, seq_len_).contiguous(), rows.slice(1, 1, seq_len_ + 1).contiguous()};
}

}  // namespace zb
