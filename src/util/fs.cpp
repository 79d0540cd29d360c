#include "util/fs.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <cstring>
#include <stdexcept>

namespace zb {

void make_directories(const std::string& path) {
  if (path.empty()) return;
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string prefix = path.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error("cannot create directory " + prefix + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw std::runtime_error("not a directory: " + path);
}

std::string parent_directory(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return "";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void remove_tree(const std::string& path) {
  if (path_exists(path) && std::system(("rm -rf '" + path + "'").c_str()) != 0)
    throw std::runtime_error("cannot remove " + path);
}

std::string project_file(const std::string& relative) {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    const std::string bin = parent_directory(std::string(exe, static_cast<size_t>(n)));
    const std::string installed = parent_directory(bin) + "/share/zeroband-cpp/" + relative;
    if (path_exists(installed)) return installed;
  }
  const std::string source = std::string(ZB_SOURCE_DIR) + "/" + relative;
  return path_exists(source) ? source : "";
}

}  // namespace zb
