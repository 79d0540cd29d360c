#pragma once
// Token shards as samples: each shard is cut into windows of seq_len + 1 tokens at a stride of
// seq_len (consecutive windows share one token, the last target of one being the first input of
// the next); the tail shorter than a window is left out. Documents are packed back to back in the
// shards, separated by EOS, so a window may span documents (as ZeroBand's packing does, without
// its dropped overflow) and positions are not reset at document boundaries.
#include <memory>
#include <string>
#include <vector>

#include "data/loader.h"
#include "data/token_shard.h"

namespace zb {

class TokenDataset : public SampleSource {
 public:
  // `paths`: comma-separated shard files and directories. Checks every shard at start-up: it
  // must parse, and every token must be below `vocab_size`; the dataset must make at least one
  // sample. Throws std::runtime_error naming the file otherwise.
  // `reverse_files` reverses the shard order (ZeroBand's reverse_data_files).
  TokenDataset(const std::string& paths, int64_t seq_len, int64_t vocab_size,
               bool reverse_files = false);

  int64_t num_samples() const override { return total_samples_; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t index, int64_t* row) const override;
  int64_t num_tokens() const;
  const std::vector<TokenShard>& shards() const { return shards_; }

 private:
  int64_t seq_len_;
  std::vector<TokenShard> shards_;
  std::vector<int64_t> first_sample_;  // of each shard
  int64_t total_samples_ = 0;
};

}  // namespace zb
