#include "data/token_dataset.h"

#include <algorithm>
#include <stdexcept>

namespace zb {

TokenDataset::TokenDataset(const std::string& paths, int64_t seq_len, int64_t vocab_size,
                           bool reverse_files)
    : seq_len_(seq_len) {
  std::vector<std::string> files = list_shards(paths);
  if (reverse_files) std::reverse(files.begin(), files.end());
  for (const auto& path : files) {
    shards_.emplace_back(path);
    const TokenShard& s = shards_.back();
    const int64_t max_token = s.max_token();
    if (max_token >= vocab_size)
      throw std::runtime_error("token shard " + path + ": token id " + std::to_string(max_token) +
                               " is not below the model's vocabulary of " + std::to_string(vocab_size) +
                               " (wrong tokenizer for this model?)");
    first_sample_.push_back(total_samples_);
    total_samples_ += std::max<int64_t>(0, (s.num_tokens() - 1) / seq_len);
  }
  if (total_samples_ == 0)
    throw std::runtime_error("dataset " + paths + ": its " + std::to_string(num_tokens()) +
                             " tokens make no sample of seq_length + 1 = " +
                             std::to_string(seq_len + 1) + " tokens");
}

int64_t TokenDataset::num_tokens() const {
  int64_t n = 0;
  for (const auto& s : shards_) n += s.num_tokens();
  return n;
}

void TokenDataset::sample(int64_t index, int64_t* row) const {
  // The shard holding this sample: the last whose first sample is <= index.
  const auto it = std::upper_bound(first_sample_.begin(), first_sample_.end(), index);
  const size_t shard = static_cast<size_t>(it - first_sample_.begin()) - 1;
  const int64_t k = index - first_sample_[shard];
  shards_[shard].read(k * seq_len_, seq_len_ + 1, row);
}

}  // namespace zb
