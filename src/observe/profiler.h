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
  // The GPU's timeline from its kernels (0 on CPU; copies and memsets not counted), seconds per
  // step: when any kernel ran, when a compute (not
  // NCCL) kernel ran, when an NCCL kernel ran. busy - compute is communication no compute hid
  // (the GPU's exposed communication); seconds_per_step - busy is the GPU idle (waiting for the
  // host's launches, or for the host itself).
  double gpu_busy_seconds_per_step = 0, gpu_compute_seconds_per_step = 0, gpu_nccl_seconds_per_step = 0;
  // The named phases as the GPU ran them, where the profiler reports them there (Kineto's GPU
  // user annotations: from the phase's first kernel to its last), longest first.
  std::vector<Phase> device_phases;
  struct Op {
    std::string name;
    double seconds_per_step = 0;  // inclusive of the operators it calls
    double count_per_step = 0;
  };
  std::vector<Op> top_ops;  // the 15 longest
  // GPU kernels by name (without "void " and the argument list, at most 160 characters), their
  // own time: the 15 longest. Where a GPU step's time goes, kernel by kernel (empty on CPU).
  std::vector<Op> top_kernels;
  // The same kernels by kind, read from their names (kernel_kind), longest first: gemm,
  // attention, ours (our kernels), norm, elementwise, copy, reduce, nccl, other.
  std::vector<Op> kernel_kinds;
  std::string to_json() const;
  // A few lines for the log: the window, its phases, the operator counts and the longest operators.
  std::vector<std::string> describe(const std::string& folder) const;
};

// A GPU kernel's kind from its name: "gemm" (cuBLAS/CUTLASS matrix products), "attention"
// (flash, cuDNN), "ours" (zb::), "norm", "elementwise", "copy" (casts and copies), "reduce",
// "nccl", else "other".
std::string kernel_kind(const std::string& name);

// What the summary reads of one recorded event.
struct ProfileEvent {
  enum class Kind { Operator, Phase, Kernel, DevicePhase } kind;
  std::string name;
  uint64_t start_ns = 0, end_ns = 0;
};
// The summary of a window of steps first_step..last_step that took wall_seconds.
ProfileSummary summarize_events(const std::vector<ProfileEvent>& events, int64_t first_step, int64_t last_step,
                                double wall_seconds);
// The same from the profiler's recorded events.
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
