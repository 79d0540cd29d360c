#include "util/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdarg>
#include <cstdio>
#include <vector>

namespace zb {

std::string strf(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::vector<char> buf(static_cast<size_t>(n) + 1);
  std::vsnprintf(buf.data(), buf.size(), fmt, args);
  va_end(args);
  return std::string(buf.data(), static_cast<size_t>(n));
}

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > (n < 0 ? 1 : 0); i -= 3) s.insert(i, ",");
  return s;
}

namespace log {
namespace {
std::shared_ptr<spdlog::logger>& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stdout_color_mt("zb");
    l->set_pattern("%H:%M:%S [%^%l%$] %v");
    return l;
  }();
  return instance;
}
}  // namespace

void init(int rank, const std::string& level) {
  auto& l = logger();
  l->set_pattern(strf("%%H:%%M:%%S [%%^%%l%%$] [rank %d] %%v", rank));
  auto lvl = spdlog::level::from_str(level);
  if (rank != 0 && lvl < spdlog::level::warn) lvl = spdlog::level::warn;
  l->set_level(lvl);
  l->flush_on(spdlog::level::warn);  // a process that dies next still leaves its last words
}
void debug(const std::string& msg) { logger()->debug(msg); }
void info(const std::string& msg) { logger()->info(msg); }
void warn(const std::string& msg) { logger()->warn(msg); }
void error(const std::string& msg) { logger()->error(msg); }
void flush() { logger()->flush(); }
}  // namespace log
}  // namespace zb
