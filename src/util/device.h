#pragma once
// Which device to run on, its name and its peak memory.
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zb {

// True when this LibTorch was built with CUDA and a GPU is visible.
bool cuda_available();
// The GPU of local rank `local_rank` among `device_count`: in turn, so that ranks beyond the
// count share them (dist/placement.h then picks the backend).
int64_t gpu_for_local_rank(int64_t local_rank, int64_t device_count);
// "auto" -> cuda:gpu_for_local_rank when available, else cpu. "cuda" without a GPU throws.
c10::Device select_device(const std::string& requested, int64_t local_rank);
// runtime.deterministic: what makes two runs of one config bit-identical on a GPU. ATen's
// deterministic algorithms (an operator without one fails, naming itself; flash attention's
// backward takes its deterministic path), cuDNN's deterministic choices without benchmarking, and a
// fixed cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8 unless the environment sets it), before
// any GPU work. Our kernels need nothing: none uses atomics, and each reduction's order is fixed
// by its launch. Uninitialised memory is not filled (nothing of ours reads it).
void use_deterministic_algorithms();
// What it sets, as the run's record shows it (resolved_run).
std::vector<std::pair<std::string, std::string>> deterministic_settings();
// Makes `device` this process's current GPU, where its streams, events and workspaces live
// (nothing on the CPU).
void use_device(const c10::Device& device);
// Sets the allocator up for training before anything is allocated: on CUDA expandable segments in
// the caching allocator, on CPU glibc's malloc keeping large buffers (see device.cpp). Settings
// the user made in the environment are kept.
void configure_allocator(const c10::Device& device);
std::string device_name(const c10::Device& device);  // the GPU's name, or "cpu"
// The GPU's compute capability as major * 10 + minor (90 for an H100), 0 on the CPU.
int device_compute_capability(const c10::Device& device);
// The GPU's PCI address ("0000:18:00.0", as nvidia-smi shows it), "" on the CPU: tells which
// physical GPU a rank drives whatever CUDA_VISIBLE_DEVICES renumbered.
std::string device_pci_bus_id(const c10::Device& device);
// Peak memory of this process on `device` since the last reset_peak_memory(): the CUDA caching
// allocator's peak allocated bytes, or on CPU the peak resident set size (VmHWM).
int64_t peak_memory_bytes(const c10::Device& device);
// On a GPU: memory this process can still use for tensors (free device memory plus what its
// caching allocator holds unused) and the device's total, in bytes; {0, 0} on the CPU.
struct DeviceMemory {
  int64_t available = 0, total = 0;
};
DeviceMemory device_memory(const c10::Device& device);
// Starts the peak from what is in use now, so that the metrics count the training steps and not
// set-up (a checkpoint read through host memory, the model built before sharding).
void reset_peak_memory(const c10::Device& device);
// Measurement only (ZB_COUNT_TENSOR_MEMORY=1, before any tensor exists): CPU tensors are counted
// as they are allocated and freed, and peak_memory_bytes on the CPU reports the peak of live
// tensor bytes instead of the resident set, comparable with the CUDA allocator's figure and with
// the memory estimate (--dry-run). Costs a locked table update per allocation.
void count_cpu_tensor_memory();
// The end of a program's main: flushes the log and the standard streams and ends the process
// with `code` without running static destructors, where no CUDA context exists (CUDA's teardown
// and the profilers attached to it, nsys, need the ordinary exit: then it returns `code`).
// LibTorch's destructors (every operator deregistered) cost about 0.1 s of CPU, a quarter of
// what a short run spends starting and ending; every object of the run is gone by then.
int end_process(int code);

// Points on the device's timeline within a step: the host clock on CPU, CUDA events on a GPU
// (recorded on the current device's current stream without waiting; the NCCL backend makes each
// rank's GPU current), so phase times are the device's, not the time to enqueue work.
//
// A mark is complete only once synchronize() has returned after it: on a GPU an event recorded
// behind queued kernels cannot be read before they finish (CUDA answers cudaErrorNotReady). The
// CPU clock keeps the same rule, so a step that reads its times too early fails on the CPU too:
// seconds() throws for a mark made after the last synchronize().
class StepClock {
 public:
  explicit StepClock(const c10::Device& device);
  ~StepClock();
  StepClock(const StepClock&) = delete;  // owns its CUDA events
  StepClock& operator=(const StepClock&) = delete;
  int mark();                        // records now; returns the mark's index
  void synchronize();                // blocks the host until every mark so far is complete
  double seconds(int from, int to);  // between two complete marks
  int marks() const { return static_cast<int>(cuda_ ? used_ : host_.size()); }
  void clear();

 private:
  bool cuda_ = false;
  std::vector<std::chrono::steady_clock::time_point> host_;
  std::vector<void*> events_;  // cudaEvent_t, created on demand and reused
  size_t used_ = 0;
  int complete_ = 0;  // marks [0, complete_) are complete
};

}  // namespace zb
