#include "train/profiler.h"

#include <ATen/record_function.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>

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

constexpr uint8_t kCpuOp = 0, kKernel = 5;  // Kineto's ActivityType: CPU_OP, CONCURRENT_KERNEL

}  // namespace

ProfileSummary summarize_profile(const prof::ProfilerResult& result, int64_t first_step, int64_t last_step,
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
  std::map<std::string, Sum> phases, ops;
  int64_t n_ops = 0, n_kernels = 0;
  for (const prof::KinetoEvent& e : result.events()) {
    const double seconds = static_cast<double>(e.durationNs()) * 1e-9;
    if (e.activityType() == kKernel) {
      ++n_kernels;
    } else if (e.scope() == static_cast<uint8_t>(at::RecordScope::USER_SCOPE)) {
      std::string name = e.name();
      name = name.substr(0, name.find(' '));  // "zb.fsdp.unshard layers.3" -> "zb.fsdp.unshard"
      phases[name].seconds += seconds;
      ++phases[name].count;
    } else if (e.activityType() == kCpuOp && e.scope() == static_cast<uint8_t>(at::RecordScope::FUNCTION)) {
      ++n_ops;
      ops[e.name()].seconds += seconds;
      ++ops[e.name()].count;
    }
  }
  for (const auto& [name, sum] : phases) s.phases.push_back({name, sum.seconds / steps, sum.count / steps});
  if (const auto wait = phases.find("zb.wait"); wait != phases.end()) s.exposed_comm_seconds_per_step = wait->second.seconds / steps;
  std::sort(s.phases.begin(), s.phases.end(), [](const auto& a, const auto& b) { return a.seconds_per_step > b.seconds_per_step; });
  for (const auto& [name, sum] : ops) s.top_ops.push_back({name, sum.seconds / steps, sum.count / steps});
  std::sort(s.top_ops.begin(), s.top_ops.end(), [](const auto& a, const auto& b) { return a.seconds_per_step > b.seconds_per_step; });
  if (s.top_ops.size() > 15) s.top_ops.resize(15);
  s.ops_per_step = static_cast<int64_t>(static_cast<double>(n_ops) / steps + 0.5);
  s.kernels_per_step = static_cast<int64_t>(static_cast<double>(n_kernels) / steps + 0.5);
  return s;
}

std::string ProfileSummary::to_json() const {
  nlohmann::json j = {{"first_step", first_step}, {"last_step", last_step}, {"seconds_per_step", seconds_per_step},
                      {"ops_per_step", ops_per_step}, {"kernels_per_step", kernels_per_step},
                      {"exposed_comm_seconds_per_step", exposed_comm_seconds_per_step}};
  j["phases"] = nlohmann::json::array();
  for (const auto& p : phases)
    j["phases"].push_back({{"name", p.name}, {"seconds_per_step", p.seconds_per_step}, {"count_per_step", p.count_per_step}});
  j["top_ops"] = nlohmann::json::array();
  for (const auto& o : top_ops)
    j["top_ops"].push_back({{"name", o.name}, {"seconds_per_step", o.seconds_per_step}, {"count_per_step", o.count_per_step}});
  return j.dump(1);
}

std::vector<std::string> ProfileSummary::describe(const std::string& folder) const {
  std::vector<std::string> lines = {
      strf("profile of steps %ld-%ld: %.3f s/step (%.3f s blocked on collectives), %ld operators dispatched per "
           "step%s; traces in %s/iteration_%ld",
           first_step, last_step, seconds_per_step, exposed_comm_seconds_per_step, ops_per_step,
           kernels_per_step > 0 ? strf(", %ld GPU kernels", kernels_per_step).c_str() : "", folder.c_str(), last_step)};
  std::string line = "  phases (s/step):";
  for (size_t i = 0; i < phases.size() && i < 12; ++i)
    line += strf(" %s %.4f%s", phases[i].name.c_str(), phases[i].seconds_per_step, i + 1 < phases.size() && i < 11 ? "," : "");
  lines.push_back(line);
  line = "  longest operators (s/step):";
  for (size_t i = 0; i < top_ops.size() && i < 6; ++i)
    line += strf(" %s %.4f (x%.0f)%s", top_ops[i].name.c_str(), top_ops[i].seconds_per_step, top_ops[i].count_per_step,
                 i + 1 < top_ops.size() && i < 5 ? "," : "");
  lines.push_back(line);
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
