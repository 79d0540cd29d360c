#include "util/device.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <unordered_map>

#include <stdexcept>

#include "util/cuda_plugin.h"
#include "util/device_cuda.h"
#include "util/log.h"

namespace zb {

#ifdef ZB_WITH_CUDA
namespace {
// The GPU side, from the GPU plugin: only ever asked about a CUDA device, which exists only where
// the plugin is loaded.
const CudaDeviceFunctions& gpu() {
  static const CudaDeviceFunctions& table = required_cuda_plugin_table<CudaDeviceFunctions>(
      "zb_cuda_device_functions", "a CUDA device without the GPU plugin (util/cuda_plugin.h)");
  return table;
}
}  // namespace
#endif

namespace {
const char* const kCublasWorkspace = ":4096:8";  // cuBLAS's documented setting for reproducible results
}

void use_deterministic_algorithms() {
  ::setenv("CUBLAS_WORKSPACE_CONFIG", kCublasWorkspace, /*overwrite=*/0);
  auto& ctx = at::globalContext();
  ctx.setDeterministicAlgorithms(true, /*warn_only=*/false);  // warn-only would leave flash's backward as it is
  ctx.setDeterministicFillUninitializedMemory(false);
  ctx.setDeterministicCuDNN(true);
  ctx.setBenchmarkCuDNN(false);
}

std::vector<std::pair<std::string, std::string>> deterministic_settings() {
  const char* workspace = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  return {{"aten_deterministic_algorithms", "true"},
          {"flash_attention_backward", "deterministic"},
          {"cudnn", "deterministic, no benchmarking"},
          {"cublas_workspace_config", workspace ? workspace : kCublasWorkspace},
          {"fill_uninitialized_memory", "false"}};
}

bool cuda_available() {
  // Where the GPU plugin is not loaded, ATen has no CUDA.
  return cuda_plugin_symbol("zb_cuda_device_functions") && at::hasCUDA() &&
         at::detail::getCUDAHooks().deviceCount() > 0;
}

// Why GPUs look present to a process that cannot use CUDA ("" when nothing says so): a launcher
// that set CUDA_VISIBLE_DEVICES, or the driver's device files.
std::string visible_gpus_hint() {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible && *visible && std::string(visible) != "-1") return std::string("CUDA_VISIBLE_DEVICES=") + visible;
  if (::access("/dev/nvidia0", F_OK) == 0) return "/dev/nvidia0 exists";
  return "";
}

int64_t gpu_for_local_rank(int64_t local_rank, int64_t device_count) { return local_rank % device_count; }

c10::Device select_device(const std::string& requested, int64_t local_rank) {
  if (requested == "cpu") return c10::Device(c10::kCPU);
  if (requested == "cuda" && !cuda_available())
    throw std::runtime_error("runtime.device = \"cuda\" but no CUDA device is available");
  // A GPU job that silently trains on the CPU wastes its allocation: "auto" falls back to the
  // CPU only where no GPU is meant to be.
  if (requested == "auto" && !cuda_available() && !visible_gpus_hint().empty())
    throw std::runtime_error(std::string("runtime.device = \"auto\": GPUs should be visible (") + visible_gpus_hint() +
                             ") but CUDA cannot use any (" +
                             (!cuda_plugin_symbol("zb_cuda_device_functions")
                                  ? "no NVIDIA driver library, libcuda.so.1, here"
                              : at::hasCUDA() ? "no device the driver lets this process use"
                                              : "this LibTorch has no CUDA") +
                             "); set runtime.device = \"cpu\" to train on the CPU");
  if (requested == "cuda" || (requested == "auto" && cuda_available())) {
    const int64_t n = at::detail::getCUDAHooks().deviceCount();
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(gpu_for_local_rank(local_rank, n)));
  }
  return c10::Device(c10::kCPU);
}

void use_device(const c10::Device& device) {
  if (device.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
}

void configure_allocator(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return gpu().configure_allocator();
#endif
  // CPU tensors come from glibc's malloc, which by default serves the step's large, short-lived
  // buffers (activations, gathered parameters, gradients; several MB each) with fresh mmaps and
  // hands them back on free, so every step pays page faults and kernel page zeroing again. Keep
  // up to 32 MiB allocations (glibc's maximum threshold) in the heap and do not trim it: about
  // 12% faster steps for the debug model on 2 cores, for a few percent more resident memory.
  // A user's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ win.
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_")) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

std::string device_name(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return gpu().device_name(device.index());
#endif
  return device.str();
}

int device_compute_capability(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return gpu().compute_capability(device.index());
#endif
  return 0;
}

std::string device_pci_bus_id(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return gpu().pci_bus_id(device.index());
#endif
  return "";
}

namespace {

// Wraps the CPU allocator and keeps the live and peak bytes of what it handed out. Each block's
// context is its own address, as ATen's raw allocations (oneDNN's buffers among them) require, so
// the wrapped allocation and its size are kept in a table beside it.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // an empty tensor's: nothing to count or to free
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, live_);
      blocks_.emplace(data, Block{std::move(inner), n});
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = live_;
  }

 private:
  struct Block {
    c10::DataPtr inner;  // frees the memory through the wrapped allocator
    size_t bytes = 0;
  };
  static void release(void* data);

  c10::Allocator* base_;
  mutable std::mutex mutex_;
  int64_t live_ = 0, peak_ = 0;
  std::unordered_map<void*, Block> blocks_;
};

CountingAllocator* counting = nullptr;

void CountingAllocator::release(void* data) {
  Block block;
  {
    std::lock_guard<std::mutex> lock(counting->mutex_);
    auto it = counting->blocks_.find(data);
    if (it == counting->blocks_.end()) return;
    block = std::move(it->second);
    counting->blocks_.erase(it);
    counting->live_ -= static_cast<int64_t>(block.bytes);
  }
}  // block.inner frees the memory here, outside the lock

}  // namespace

void count_cpu_tensor_memory() {
  if (counting) return;
  counting = new CountingAllocator(c10::GetCPUAllocator());  // lives as long as the tensors
  c10::SetCPUAllocator(counting, /*priority=*/100);
}

int64_t peak_memory_bytes(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return gpu().peak_memory_bytes(device.index());
#endif
  if (counting) return counting->peak();
  // VmHWM rather than getrusage's ru_maxrss: only the former can be reset (clear_refs).
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // in kB
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

DeviceMemory device_memory(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return gpu().device_memory(device.index());
#endif
  return {};
}

void reset_peak_memory(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return gpu().reset_peak_memory(device.index());
#endif
  if (counting) counting->reset_peak();
  std::ofstream("/proc/self/clear_refs") << "5";  // 5: high-water mark := current resident size
}

}  // namespace zb

namespace zb {

StepClock::StepClock(const c10::Device& device) : cuda_(device.is_cuda()) {}

StepClock::~StepClock() {
#ifdef ZB_WITH_CUDA
  for (void* e : events_) gpu().event_destroy(e);
#endif
}

int StepClock::mark() {
#ifdef ZB_WITH_CUDA
  if (cuda_) {
    if (used_ == events_.size()) events_.push_back(gpu().event_create());
    gpu().event_record(events_[used_]);
    return static_cast<int>(used_++);
  }
#endif
  host_.push_back(std::chrono::steady_clock::now());
  return static_cast<int>(host_.size() - 1);
}

void StepClock::synchronize() {
#ifdef ZB_WITH_CUDA
  // Marks are recorded on one stream in order: the last one complete means all are.
  if (cuda_ && used_ > 0) gpu().event_synchronize(events_[used_ - 1]);
#endif
  complete_ = marks();
}

double StepClock::seconds(int from, int to) {
  if (std::max(from, to) >= complete_)
    throw std::logic_error("StepClock: mark " + std::to_string(std::max(from, to)) +
                           " read before synchronize() (a device event is not ready until the host has "
                           "waited for it)");
#ifdef ZB_WITH_CUDA
  if (cuda_) return gpu().event_seconds(events_[from], events_[to]);
#endif
  return std::chrono::duration<double>(host_[to] - host_[from]).count();
}

void StepClock::clear() {
  host_.clear();
  used_ = 0;
  complete_ = 0;
}

int end_process(int code) {
  const auto& cuda = at::detail::getCUDAHooks();
  if (cuda.hasCUDA())
    for (int i = 0; i < cuda.getNumGPUs(); ++i)
      if (cuda.hasPrimaryContext(static_cast<c10::DeviceIndex>(i))) return code;
  log::flush();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}

}  // namespace zb
