#pragma once
// Small file-system helpers on POSIX calls. The torch wheel's libtorch.so exports copies of some
// std::filesystem functions (remove_all, copy, permissions, ...) that interpose on libstdc++'s
// and crash when called from our code, so the project avoids std::filesystem altogether.
#include <string>

namespace zb {

// mkdir -p. Throws std::runtime_error naming the path on failure.
void make_directories(const std::string& path);
// "a/b/c.txt" -> "a/b"; "c.txt" -> "".
std::string parent_directory(const std::string& path);
bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// The whole file; throws std::runtime_error naming it when it cannot be read.
std::string read_file(const std::string& path);
// rm -rf (no-op for a missing path; symbolic links removed, not followed); throws on failure.
void remove_tree(const std::string& path);
// Makes a directory's entries (files created, renamed or removed in it) durable: fsync of the
// directory itself. Throws naming it; a file system that cannot sync directories is left as it is.
void sync_directory(const std::string& path);

// A file the project ships beside its programs ("scripts/watch/follow_metrics.py", "configs/..."): from
// an installed tree (`cmake --install`, wherever it was moved since), <prefix>/share/zeroband-cpp/
// next to the program's <prefix>/bin; from a build tree, the source tree's. "" when neither has it.
std::string project_file(const std::string& relative);

}  // namespace zb
