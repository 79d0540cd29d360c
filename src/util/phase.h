#pragma once
// A named phase of a training step ("zb.forward", "zb.fsdp.unshard layers.3", ...): a user scope
// that LibTorch's profiler records around the operators it contains (observe/profiler.h: the
// traces and their summary) and that becomes an NVTX range under profiling.nvtx on CUDA (Nsight
// Systems shows it without the profiler). While nothing records, a phase costs one check of a
// thread-local flag: the name is only put together when it is recorded.
#include <ATen/record_function.h>

#include <string>

namespace zb {

class Phase {
 public:
  explicit Phase(const char* name) : guard_(at::RecordScope::USER_SCOPE) {
    if (guard_.isActive()) guard_.before(name);
  }
  // "name detail" (a unit, a block, a bucket).
  Phase(const char* name, const std::string& detail) : guard_(at::RecordScope::USER_SCOPE) {
    if (guard_.isActive()) guard_.before(std::string(name) + " " + detail);
  }
  Phase(const char* name, int64_t index) : guard_(at::RecordScope::USER_SCOPE) {
    if (guard_.isActive()) guard_.before(std::string(name) + " " + std::to_string(index));
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  at::RecordFunction guard_;
};

}  // namespace zb
