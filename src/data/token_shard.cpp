#include "data/token_shard.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "util/fs.h"

namespace zb {

namespace {
std::runtime_error shard_error(const std::string& path, const std::string& what) {
  return std::runtime_error("token shard " + path + ": " + what);
}
}  // namespace

TokenShard::TokenShard(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw shard_error(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  const int64_t size = st.st_size;
  if (size < kShardHeaderBytes) {
    ::close(fd);
    throw shard_error(path, "not a token shard (" + std::to_string(size) +
                                " bytes, shorter than the 1024-byte header)");
  }
  int32_t header[256];
  if (::pread(fd, header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
    ::close(fd);
    throw shard_error(path, "cannot read the header");
  }
  if (header[0] == kShardMagicU16 && header[1] == kShardVersionU16) width_ = 2;
  else if (header[0] == kShardMagicU32 && header[1] == kShardVersionU32) width_ = 4;
  else {
    ::close(fd);
    throw shard_error(path, "not a token shard (magic " + std::to_string(header[0]) + ", version " +
                                std::to_string(header[1]) + "; expected 20240520 v1 or 20240801 v7)");
  }
  num_tokens_ = header[2];
  const int64_t expected = kShardHeaderBytes + num_tokens_ * width_;
  if (num_tokens_ < 0 || size != expected) {
    ::close(fd);
    throw shard_error(path, "truncated or damaged: the header promises " + std::to_string(num_tokens_) +
                                " tokens (" + std::to_string(expected) + " bytes) but the file has " +
                                std::to_string(size) + " bytes");
  }
  map_bytes_ = static_cast<size_t>(size);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw shard_error(path, std::string("cannot map: ") + std::strerror(errno));
  }
}

TokenShard::~TokenShard() {
  if (map_) ::munmap(map_, map_bytes_);
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)), num_tokens_(other.num_tokens_), width_(other.width_),
      map_(other.map_), map_bytes_(other.map_bytes_) {
  other.map_ = nullptr;
}

void TokenShard::read(int64_t start, int64_t n, int64_t* out) const {
  if (start < 0 || start + n > num_tokens_)
    throw shard_error(path_, "read past the end");
  const char* body = static_cast<const char*>(map_) + kShardHeaderBytes;
  if (width_ == 2) {
    const auto* t = reinterpret_cast<const uint16_t*>(body) + start;
    for (int64_t i = 0; i < n; ++i) out[i] = t[i];
  } else {
    const auto* t = reinterpret_cast<const uint32_t*>(body) + start;
    for (int64_t i = 0; i < n; ++i) out[i] = t[i];
  }
}

int64_t TokenShard::max_token() const {
  const char* body = static_cast<const char*>(map_) + kShardHeaderBytes;
  int64_t m = -1;
  if (width_ == 2) {
    const auto* t = reinterpret_cast<const uint16_t*>(body);
    for (int64_t i = 0; i < num_tokens_; ++i) m = std::max<int64_t>(m, t[i]);
  } else {
    const auto* t = reinterpret_cast<const uint32_t*>(body);
    for (int64_t i = 0; i < num_tokens_; ++i) m = std::max<int64_t>(m, t[i]);
  }
  return m;
}

void write_token_shard(const std::string& path, const std::vector<int64_t>& tokens) {
  const bool narrow = std::all_of(tokens.begin(), tokens.end(), [](int64_t t) { return t >= 0 && t < 65536; });
  int32_t header[256] = {};
  header[0] = narrow ? kShardMagicU16 : kShardMagicU32;
  header[1] = narrow ? kShardVersionU16 : kShardVersionU32;
  header[2] = static_cast<int32_t>(tokens.size());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw shard_error(path, std::string("cannot write: ") + std::strerror(errno));
  std::fwrite(header, sizeof header, 1, f);
  for (int64_t t : tokens) {
    if (narrow) {
      const uint16_t v = static_cast<uint16_t>(t);
      std::fwrite(&v, 2, 1, f);
    } else {
      const uint32_t v = static_cast<uint32_t>(t);
      std::fwrite(&v, 4, 1, f);
    }
  }
  if (std::fclose(f) != 0) throw shard_error(path, "write failed");
}

namespace {
bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::strlen(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

// The first file under `dir` (3 levels deep at most) that make_shards could turn into shards:
// text as users keep it (fineweb-edu's parquet, JSON lines, plain text) or a Hugging Face
// dataset saved to disk. "" if there is none.
std::string raw_data_in(const std::string& dir, int depth = 0) {
  std::string found;
  std::vector<std::string> subdirs;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name, path = dir + "/" + name;
      if (name[0] == '.') continue;
      if (ends_with(name, ".parquet") || ends_with(name, ".jsonl") || ends_with(name, ".txt") ||
          ends_with(name, ".arrow") || name == "dataset_info.json" || name == "dataset_dict.json")
        found = path;
      else if (depth < 2 && is_directory(path))
        subdirs.push_back(path);
      if (!found.empty()) break;
    }
    ::closedir(d);
  }
  for (size_t i = 0; found.empty() && i < subdirs.size(); ++i) found = raw_data_in(subdirs[i], depth + 1);
  return found;
}
}  // namespace

std::vector<std::string> list_shards(const std::string& paths) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= paths.size()) {
    size_t comma = paths.find(',', start);
    if (comma == std::string::npos) comma = paths.size();
    const std::string entry = paths.substr(start, comma - start);
    start = comma + 1;
    if (entry.empty()) continue;
    struct stat st {};
    if (::stat(entry.c_str(), &st) != 0)
      throw std::runtime_error("dataset path " + entry + " does not exist");
    if (!S_ISDIR(st.st_mode)) {
      out.push_back(entry);
      continue;
    }
    std::vector<std::string> files;
    if (DIR* dir = ::opendir(entry.c_str())) {
      while (dirent* e = ::readdir(dir)) {
        const std::string name = e->d_name;
        if (name.size() > 4 && name.compare(name.size() - 4, 4, ".bin") == 0)
          files.push_back(entry + "/" + name);
      }
      ::closedir(dir);
    }
    if (files.empty()) {
      const std::string raw = raw_data_in(entry);
      if (raw.empty()) throw std::runtime_error("dataset directory " + entry + " holds no *.bin token shard");
      std::string out = entry;
      while (out.size() > 1 && out.back() == '/') out.pop_back();
      out += "-shards";
      const std::string make_shards = project_file("scripts/data/make_shards.py");
      throw std::runtime_error(
          "dataset directory " + entry + " holds no *.bin token shard but holds data to make them from (" + raw +
          "): train_fsdp trains on token shards. Make them with\n  python " +
          (make_shards.empty() ? "scripts/data/make_shards.py" : make_shards) + " " + out + " " + entry +
          " --tokenizer TOKENIZER.json   (or --train-vocab 32000)\nthen train with --data.dataset_name_or_paths " +
          out + "/train --data.val_dataset_name_or_paths " + out + "/val");
    }
    std::sort(files.begin(), files.end());
    out.insert(out.end(), files.begin(), files.end());
  }
  if (out.empty()) throw std::runtime_error("no dataset path given");
  return out;
}

}  // namespace zb
