#include "observe/profiler.h"

#include <ATen/record_function.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <optional>

#include "util/device.h"
#include "util/fs.h"
#include "util/log.h"

namespace zb {

namespace {

namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Kineto's ActivityType: CPU_OP, GPU_USER_ANNOTATION, CONCURRENT_KERNEL.
constexpr uint8_t kCpuOp = 0, kGpuUserAnnotation = 2, kKernel = 5;

// The time covered by the union of intervals [start, end), in seconds (sorts them).
double covered_seconds(std::vector<std::pair<uint64_t, uint64_t>>& spans) {
  std::sort(spans.begin(), spans.end());
  uint64_t covered = 0, reach = 0;
  for (const auto& [start, end] : spans) {
    const uint64_t from = std::max(start, reach);
    if (end > from) covered += end - from;
    reach = std::max(reach, end);
  }
  return static_cast<double>(covered) * 1e-9;
}

// "zb.fsdp.unshard layers.3" -> "zb.fsdp.unshard": a phase without its detail.
std::string phase_name(const std::string& name) { return name.substr(0, name.find(' ')); }

// "void at::native::(anonymous namespace)::kernel<128, 4>(int, float*)" ->
// "at::native::(anonymous namespace)::kernel<128, 4>": the kernel and its template instance. The
// argument list is the last parenthesised group, matched from the end.
std::string without_parameters(const std::string& name) {
  std::string k = name.rfind("void ", 0) == 0 ? name.substr(5) : name;
  if (!k.empty() && k.back() == ')') {
    int depth = 0;
    for (size_t i = k.size(); i-- > 0;) {
      if (k[i] == ')') ++depth;
      else if (k[i] == '(' && --depth == 0) {
        k.resize(i);
        break;
      }
    }
  }
  return k;
}

// A summary row's name: at most 160 characters, short enough to read.
std::string row_name(const std::string& k) { return k.size() > 160 ? k.substr(0, 157) + "..." : k; }

// The kind of a kernel named k (without_parameters: template arguments count, parameters do not).
std::string kind_of(const std::string& k) {
  const auto has = [&](std::initializer_list<const char*> parts) {
    for (const char* part : parts)
      if (k.find(part) != std::string::npos) return true;
    return false;
  };
  if (k.rfind("nccl", 0) == 0) return "nccl";
  if (k.rfind("zb::", 0) == 0) return "ours";
  if (has({"flash", "fmha", "attention", "cudnn"})) return "attention";
  if (has({"gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_", "sm80_"})) return "gemm";
  if (has({"layer_norm", "rms_norm", "RmsNorm", "LayerNorm"})) return "norm";  // the layers' (not gradient norms)
  if (has({"copy", "Copy"})) return "copy";  // casts run as direct_copy_kernel
  if (has({"reduce", "Reduce"})) return "reduce";
  if (has({"elementwise", "vectorized"})) return "elementwise";
  return "other";
}

}  // namespace

std::string kernel_kind(const std::string& name) { return kind_of(without_parameters(name)); }

ProfileSummary summarize_events(const std::vector<ProfileEvent>& events, int64_t first_step, int64_t last_step,
                                double wall_seconds) {
  ProfileSummary s;
  s.first_step = first_step;
  s.last_step = last_step;
  const double steps = static_cast<double>(last_step - first_step + 1);
  s.seconds_per_step = wall_seconds / steps;
  struct Sum {
    double seconds = 0;
    int64_t count = 0;
  };
  std::map<std::string, Sum> phases, device_phases, ops, kernels, kinds;
  std::vector<std::pair<uint64_t, uint64_t>> all, compute, nccl;  // kernels' spans
  int64_t n_ops = 0, n_kernels = 0;
  for (const ProfileEvent& e : events) {
    const double seconds = static_cast<double>(e.end_ns - e.start_ns) * 1e-9;
    Sum* sum = nullptr;
    switch (e.kind) {
      case ProfileEvent::Kind::Kernel: {
        ++n_kernels;
        const std::string k = without_parameters(e.name), kind = kind_of(k);
        all.emplace_back(e.start_ns, e.end_ns);
        (kind == "nccl" ? nccl : compute).emplace_back(e.start_ns, e.end_ns);
        sum = &kernels[row_name(k)];
        kinds[kind].seconds += seconds;
        ++kinds[kind].count;
        break;
      }
      case ProfileEvent::Kind::Phase: sum = &phases[phase_name(e.name)]; break;
      case ProfileEvent::Kind::DevicePhase: sum = &device_phases[phase_name(e.name)]; break;
      case ProfileEvent::Kind::Operator:
        ++n_ops;
        sum = &ops[e.name];
        break;
    }
    if (sum) {
      sum->seconds += seconds;
      ++sum->count;
    }
  }
  const auto longest_first = [](const auto& a, const auto& b) { return a.seconds_per_step > b.seconds_per_step; };
  for (const auto& [name, sum] : phases) s.phases.push_back({name, sum.seconds / steps, sum.count / steps});
  std::sort(s.phases.begin(), s.phases.end(), longest_first);
  for (const auto& [name, sum] : device_phases) s.device_phases.push_back({name, sum.seconds / steps, sum.count / steps});
  std::sort(s.device_phases.begin(), s.device_phases.end(), longest_first);
  if (const auto wait = phases.find("zb.wait"); wait != phases.end()) s.exposed_comm_seconds_per_step = wait->second.seconds / steps;
  for (const auto& [name, sum] : ops) s.top_ops.push_back({name, sum.seconds / steps, sum.count / steps});
  std::sort(s.top_ops.begin(), s.top_ops.end(), longest_first);
  if (s.top_ops.size() > 15) s.top_ops.resize(15);
  for (const auto& [name, sum] : kernels) s.top_kernels.push_back({name, sum.seconds / steps, sum.count / steps});
  std::sort(s.top_kernels.begin(), s.top_kernels.end(), longest_first);
  if (s.top_kernels.size() > 15) s.top_kernels.resize(15);
  for (const auto& [name, sum] : kinds) s.kernel_kinds.push_back({name, sum.seconds / steps, sum.count / steps});
  std::sort(s.kernel_kinds.begin(), s.kernel_kinds.end(), longest_first);
  s.ops_per_step = static_cast<int64_t>(static_cast<double>(n_ops) / steps + 0.5);
  s.kernels_per_step = static_cast<int64_t>(static_cast<double>(n_kernels) / steps + 0.5);
  s.gpu_busy_seconds_per_step = covered_seconds(all) / steps;
  s.gpu_compute_seconds_per_step = covered_seconds(compute) / steps;
  s.gpu_nccl_seconds_per_step = covered_seconds(nccl) / steps;
  return s;
}

ProfileSummary summarize_profile(const prof::ProfilerResult& result, int64_t first_step, int64_t last_step,
                                 double wall_seconds) {
  std::vector<ProfileEvent> events;
  for (const prof::KinetoEvent& e : result.events()) {
    using Kind = ProfileEvent::Kind;
    std::optional<Kind> kind;
    if (e.activityType() == kKernel) kind = Kind::Kernel;
    else if (e.activityType() == kGpuUserAnnotation) kind = Kind::DevicePhase;
    else if (e.scope() == static_cast<uint8_t>(at::RecordScope::USER_SCOPE)) kind = Kind::Phase;
    else if (e.activityType() == kCpuOp && e.scope() == static_cast<uint8_t>(at::RecordScope::FUNCTION)) kind = Kind::Operator;
    if (kind) events.push_back({*kind, e.name(), e.startNs(), e.startNs() + e.durationNs()});
  }
  return summarize_events(events, first_step, last_step, wall_seconds);
}

std::string ProfileSummary::to_json() const {
  nlohmann::json j = {{"first_step", first_step}, {"last_step", last_step}, {"seconds_per_step", seconds_per_step},
                      {"ops_per_step", ops_per_step}, {"kernels_per_step", kernels_per_step},
                      {"exposed_comm_seconds_per_step", exposed_comm_seconds_per_step},
                      {"gpu_busy_seconds_per_step", gpu_busy_seconds_per_step},
                      {"gpu_compute_seconds_per_step", gpu_compute_seconds_per_step},
                      {"gpu_nccl_seconds_per_step", gpu_nccl_seconds_per_step}};
  const auto rows = [](const auto& list) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& x : list)
      out.push_back({{"name", x.name}, {"seconds_per_step", x.seconds_per_step}, {"count_per_step", x.count_per_step}});
    return out;
  };
  j["phases"] = rows(phases);
  j["device_phases"] = rows(device_phases);
  j["top_ops"] = rows(top_ops);
  j["top_kernels"] = rows(top_kernels);
  j["kernel_kinds"] = rows(kernel_kinds);
  return j.dump(1);
}

std::vector<std::string> ProfileSummary::describe(const std::string& folder) const {
  std::vector<std::string> lines = {
      strf("profile of steps %ld-%ld: %.3f s/step (%.3f s blocked on collectives), %ld operators dispatched per "
           "step%s; traces in %s/iteration_%ld",
           first_step, last_step, seconds_per_step, exposed_comm_seconds_per_step, ops_per_step,
           kernels_per_step > 0 ? strf(", %ld GPU kernels", kernels_per_step).c_str() : "", folder.c_str(), last_step)};
  if (kernels_per_step > 0)
    lines.push_back(strf("  GPU kernels (s/step): busy %.4f of %.4f (%.1f%%), compute kernels %.4f, NCCL kernels %.4f of which "
                         "%.4f exposed (no compute beside them), idle %.4f",
                         gpu_busy_seconds_per_step, seconds_per_step,
                         seconds_per_step > 0 ? 100 * gpu_busy_seconds_per_step / seconds_per_step : 0.0,
                         gpu_compute_seconds_per_step, gpu_nccl_seconds_per_step,
                         gpu_busy_seconds_per_step - gpu_compute_seconds_per_step,
                         std::max(0.0, seconds_per_step - gpu_busy_seconds_per_step)));
  const auto phase_line = [&](const char* title, const std::vector<Phase>& list) {
    std::string line = title;
    for (size_t i = 0; i < list.size() && i < 12; ++i)
      line += strf(" %s %.4f%s", list[i].name.c_str(), list[i].seconds_per_step, i + 1 < list.size() && i < 11 ? "," : "");
    lines.push_back(line);
  };
  phase_line(kernels_per_step > 0 ? "  phases on the host (s/step):" : "  phases (s/step):", phases);
  if (!device_phases.empty()) phase_line("  phases on the GPU (s/step):", device_phases);
  std::string line = "  longest operators (s/step):";
  for (size_t i = 0; i < top_ops.size() && i < 6; ++i)
    line += strf(" %s %.4f (x%.0f)%s", top_ops[i].name.c_str(), top_ops[i].seconds_per_step, top_ops[i].count_per_step,
                 i + 1 < top_ops.size() && i < 5 ? "," : "");
  lines.push_back(line);
  if (!kernel_kinds.empty()) {  // shares of the kernels' own time (overlapping kernels each count)
    double total = 0;
    for (const Op& k : kernel_kinds) total += k.seconds_per_step;
    line = "  GPU kernels by kind (s/step):";
    for (size_t i = 0; i < kernel_kinds.size(); ++i)
      line += strf(" %s %.4f (%.0f%%)%s", kernel_kinds[i].name.c_str(), kernel_kinds[i].seconds_per_step,
                   total > 0 ? 100 * kernel_kinds[i].seconds_per_step / total : 0.0, i + 1 < kernel_kinds.size() ? "," : "");
    lines.push_back(line);
  }
  if (!top_kernels.empty()) {
    line = "  longest GPU kernels (s/step):";
    for (size_t i = 0; i < top_kernels.size() && i < 5; ++i) {
      const std::string& name = top_kernels[i].name;
      line += strf(" %s %.4f (x%.0f)%s", (name.size() > 70 ? name.substr(0, 67) + "..." : name).c_str(),
                   top_kernels[i].seconds_per_step, top_kernels[i].count_per_step, i + 1 < top_kernels.size() && i < 4 ? "," : "");
    }
    lines.push_back(line);
  }
  return lines;
}

StepProfiler::StepProfiler(const ProfilingConfig& config, const std::string& run_dir, int64_t rank,
                           const c10::Device& device)
    : config_(config), rank_(rank), device_(device) {
  if (config.nvtx && device.is_cuda()) {
    // The legacy profiler's NVTX mode: every RecordFunction (operators and our phases) pushes and
    // pops an NVTX range, for `nsys profile`; nothing is collected in the process.
    prof::enableProfilerLegacy(impl::ProfilerConfig(impl::ProfilerState::NVTX));
    nvtx_ = true;
    log::info("profiling: NVTX ranges for every phase and operator (run under nsys profile to see them)");
  }
  if (!config.enable_profiling) return;
  folder_ = config.save_traces_folder;
  if (!folder_.empty() && folder_[0] != '/') folder_ = (run_dir.empty() ? std::string(".") : run_dir) + "/" + folder_;
  if (rank == 0)
    log::info(strf("profiling: the last %ld of every %ld steps into %s (%s)", config.profile_active, config.profile_freq,
                   folder_.c_str(), device.is_cuda() ? "CPU operators and GPU kernels" : "CPU operators"));
}

StepProfiler::~StepProfiler() {
  try {
    if (recording_) prof::disableProfiler();
    if (nvtx_) prof::disableProfilerLegacy();
  } catch (const std::exception&) {
  }
}

bool StepProfiler::in_window(int64_t step) const {
  return config_.enable_profiling && (step - 1) % config_.profile_freq >= config_.profile_freq - config_.profile_active;
}

void StepProfiler::step_begin(int64_t step) {
  if (recording_ || !in_window(step)) return;
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (device_.is_cuda()) activities.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig cfg(impl::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                 /*profile_memory=*/config_.profile_memory);
  prof::prepareProfiler(cfg, activities);
  prof::enableProfiler(cfg, activities);
  recording_ = true;
  window_start_ = step;
  window_start_time_ = now_seconds();
}

std::optional<ProfileSummary> StepProfiler::step_end(int64_t step) {
  if (!recording_ || step % config_.profile_freq != 0) return std::nullopt;
  return close(step);
}

std::optional<ProfileSummary> StepProfiler::finish(int64_t step) {
  if (!recording_) return std::nullopt;
  return close(step);
}

ProfileSummary StepProfiler::close(int64_t step) {
  if (device_.is_cuda()) {  // the GPU's side of the window is complete
    StepClock clock(device_);
    clock.mark();
    clock.synchronize();
  }
  const double wall = now_seconds() - window_start_time_;
  std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  recording_ = false;
  const std::string dir = folder_ + "/iteration_" + std::to_string(step);
  make_directories(dir);
  const std::string stem = dir + "/rank" + std::to_string(rank_);
  result->save(stem + "_trace.json");
  ProfileSummary summary = summarize_profile(*result, window_start_, step, wall);
  std::ofstream(stem + "_summary.json") << summary.to_json() << "\n";
  return summary;
}

}  // namespace zb
