#pragma once
// Where a step's time goes (torchtitan's [profiling]): every profiling.profile_freq steps, the
// last profiling.profile_active of them are recorded with LibTorch's profiler (Kineto: the CPU's
// operators and the named phases of util/phase.h; on CUDA also the GPU's kernels and copies), and
// each rank writes, N being the window's last step:
//   <save_traces_folder>/iteration_<N>/rank<R>_trace.json    Chrome trace (Perfetto, chrome://tracing)
//   <save_traces_folder>/iteration_<N>/rank<R>_summary.json  time by phase, top operators, counts
// The summary is what a person reads first: seconds per step in each phase, the host's time
// blocked on collectives, the operators dispatched per step (the CPU-side measure of launch
// overhead) and the operators that took longest. Recording never changes what is computed.
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"

namespace torch::autograd::profiler {
struct ProfilerResult;
}

namespace zb {

struct ProfileSummary {
  int64_t first_step = 0, last_step = 0;
  double seconds_per_step = 0;  // wall time of the window's steps, per step
  // Named phases ("zb.forward", "zb.fsdp.unshard", ...; a phase's detail, such as its unit, left
  // out): seconds and occurrences per step, longest first.
  struct Phase {
    std::string name;
    double seconds_per_step = 0;
    double count_per_step = 0;
  };
  std::vector<Phase> phases;
  // The host's time blocked on collectives (the zb.wait phases), per step: exposed communication
  // on a CPU; on a GPU only the host's side of it (NCCL's waits order streams), the trace has the rest.
  double exposed_comm_seconds_per_step = 0;
  int64_t ops_per_step = 0;      // ATen operators dispatched (nested ones too), per step
  int64_t kernels_per_step = 0;  // GPU kernels launched, per step (0 on CPU)
  struct Op {
    std::string name;
    double seconds_per_step = 0;  // inclusive of the operators it calls
    double count_per_step = 0;
  };
  std::vector<Op> top_ops;  // the 15 longest
  std::string to_json() const;
  // A few lines for the log: the window, its phases, the operator counts and the longest operators.
  std::vector<std::string> describe(const std::string& folder) const;
};

// Reads the recorded events of a window of `steps` steps.
ProfileSummary summarize_profile(const torch::autograd::profiler::ProfilerResult& result, int64_t first_step,
                                 int64_t last_step, double wall_seconds);

class StepProfiler {
 public:
  // `run_dir`: where a relative save_traces_folder goes (the metrics file's directory).
  StepProfiler(const ProfilingConfig& config, const std::string& run_dir, int64_t rank, const c10::Device& device);
  ~StepProfiler();  // stops a window or NVTX marking still on, writing nothing
  // Around each training step: begin starts recording when `step` opens a window, end closes a
  // window that ends at `step` and writes its files (returns the summary then).
  void step_begin(int64_t step);
  std::optional<ProfileSummary> step_end(int64_t step);
  // The run ends (or stops) after `step`: a window still open is closed and written.
  std::optional<ProfileSummary> finish(int64_t step);
  // The folder traces are written to ("" when profiling is off).
  const std::string& folder() const { return folder_; }

 private:
  bool in_window(int64_t step) const;
  ProfileSummary close(int64_t step);

  ProfilingConfig config_;
  std::string folder_;
  int64_t rank_;
  c10::Device device_;
  bool recording_ = false, nvtx_ = false;
  int64_t window_start_ = 0;
  double window_start_time_ = 0;
};

}  // namespace zb
