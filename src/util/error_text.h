#pragma once
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace zb {

// An error's message for the user: c10's errors carry a C++ backtrace in what(), left out here.
inline std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace zb
