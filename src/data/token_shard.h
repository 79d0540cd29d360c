#pragma once
// Token shards on disk: llm.c's format, which is also ours.
//   header: 256 little-endian int32 (1024 bytes): [0] magic, [1] version, [2] token count
//   body:   the tokens, uint16 (magic 20240520, version 1) or uint32 (magic 20240801, version 7)
// Files are memory-mapped; nothing is read until a sample is asked for.
#include <cstdint>
#include <string>
#include <vector>

namespace zb {

constexpr int32_t kShardMagicU16 = 20240520, kShardVersionU16 = 1;
constexpr int32_t kShardMagicU32 = 20240801, kShardVersionU32 = 7;
constexpr int64_t kShardHeaderBytes = 256 * 4;

class TokenShard {
 public:
  // Maps `path` and checks its header and size. Throws std::runtime_error naming the file for a
  // missing file, an unknown magic or version, or a size that does not match the token count.
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  TokenShard(TokenShard&&) noexcept;

  const std::string& path() const { return path_; }
  int64_t num_tokens() const { return num_tokens_; }
  int bytes_per_token() const { return width_; }
  // Copies tokens [start, start + n) into out.
  void read(int64_t start, int64_t n, int64_t* out) const;
  // The largest token id in the shard (scans it once; used to check against the vocabulary).
  int64_t max_token() const;

 private:
  std::string path_;
  int64_t num_tokens_ = 0;
  int width_ = 2;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
};

// Writes a shard (uint16 when every token fits, else uint32). Throws on I/O errors.
void write_token_shard(const std::string& path, const std::vector<int64_t>& tokens);

// The shard files named by a comma-separated list of files and directories (a directory means
// its *.bin files, sorted). Throws naming the entry when one does not exist or a directory
// holds no shard.
std::vector<std::string> list_shards(const std::string& paths);

}  // namespace zb
