#pragma once
// Console logging. spdlog lives only in log.cpp: the torch wheel ships its own fmt headers, which
// must never meet Debian's fmt (that spdlog is built against) in one translation unit.
#include <cstdint>
#include <string>

namespace zb {

// printf-style formatting into a std::string.
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// 1234567 -> "1,234,567".
std::string with_commas(int64_t n);

namespace log {
// level: "debug" | "info" | "warn" | "error". Ranks other than 0 print only warnings and errors.
void init(int rank, const std::string& level = "info");
void debug(const std::string& msg);
void info(const std::string& msg);
void warn(const std::string& msg);
void error(const std::string& msg);
// Warnings and errors are flushed as they are logged; this flushes the rest (before _Exit).
void flush();
}  // namespace log
}  // namespace zb
