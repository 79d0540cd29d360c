#include "dist/world.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

extern char** environ;

namespace zb {
namespace {

struct Env {
  const std::map<std::string, std::string>& vars;
  bool has(const char* name) const { return vars.count(name) > 0; }
  std::string str(const char* name, const std::string& fallback) const {
    auto it = vars.find(name);
    return it == vars.end() ? fallback : it->second;
  }
  int64_t num(const char* name, int64_t fallback) const {
    auto it = vars.find(name);
    if (it == vars.end()) return fallback;
    const std::string& s = it->second;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    // Digits, a minus sign at most: no spaces, no '+', nothing after, nothing out of range.
    if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '-') || *end != '\0' ||
        errno == ERANGE || v > INT32_MAX || v < INT32_MIN)
      throw std::invalid_argument(std::string(name) + "='" + s + "' is not an integer");
    return v;
  }
};

// An srun step's tasks on this node: SLURM_STEP_TASKS_PER_NODE ("2(x3),1": 2 on each of the first
// three nodes, 1 on the fourth) at SLURM_NODEID. Without them, the whole step (one node).
int64_t slurm_tasks_on_this_node(const Env& env, int64_t step_tasks) {
  if (!env.has("SLURM_STEP_TASKS_PER_NODE") || !env.has("SLURM_NODEID")) return step_tasks;
  const std::string spec = env.str("SLURM_STEP_TASKS_PER_NODE", "");
  const int64_t node = env.num("SLURM_NODEID", 0);
  int64_t first = 0;  // the first node of the current group
  size_t at = 0;
  while (at < spec.size()) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string group = spec.substr(at, comma - at);
    int tasks = 0, repeat = 1;
    char tail = 0;
    const int read = std::sscanf(group.c_str(), "%d(x%d)%c", &tasks, &repeat, &tail);
    if (!(read == 1 || read == 2) || tasks < 1 || repeat < 1 || (read == 1 && group.find('(') != std::string::npos))
      throw std::invalid_argument("SLURM_STEP_TASKS_PER_NODE='" + spec + "' is not a list like 2(x3),1");
    if (node < first + repeat) return tasks;
    first += repeat;
    at = comma + 1;
  }
  throw std::invalid_argument("SLURM_NODEID=" + std::to_string(node) + " is beyond SLURM_STEP_TASKS_PER_NODE='" +
                              spec + "'");
}

}  // namespace

World detect_world(const std::map<std::string, std::string>& vars) {
  const Env env{vars};
  World w;
  // The first launcher whose rank variable is set; torchrun also needs WORLD_SIZE.
  struct Launcher {
    const char *name, *rank, *size, *local_rank, *local_size;
  };
  static const Launcher launchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      // An srun step's (SLURM_STEP_NUM_TASKS): a batch script's own process also has SLURM_PROCID
      // and SLURM_NTASKS, and is one process, not rank 0 of the allocation's tasks.
      {"SLURM", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", nullptr},
  };
  std::string names = "";  // the variables the values came from, for the messages
  for (const Launcher& l : launchers) {
    if (!env.has(l.rank) || !env.has(l.size)) continue;
    w.launcher = l.name;
    w.rank = env.num(l.rank, 0);
    w.size = env.num(l.size, 1);
    w.local_rank = env.num(l.local_rank, w.rank);
    w.local_size = l.local_size ? env.num(l.local_size, w.size) : slurm_tasks_on_this_node(env, w.size);
    names = std::string(l.rank) + ", " + l.size + ", " + l.local_rank + ", " +
            (l.local_size ? l.local_size : "SLURM_STEP_TASKS_PER_NODE");
    break;
  }
  w.master_addr = env.str("MASTER_ADDR", w.master_addr);
  w.master_port = env.num("MASTER_PORT", w.master_port);

  const std::string who = " (from " + w.launcher + (names.empty() ? "" : ": " + names) + ")";
  if (w.size < 1) throw std::invalid_argument("world size " + std::to_string(w.size) + " must be >= 1" + who);
  if (w.rank < 0 || w.rank >= w.size)
    throw std::invalid_argument("rank " + std::to_string(w.rank) + " is outside [0, " +
                                std::to_string(w.size) + ")" + who);
  if (w.local_size < 1 || w.local_rank < 0 || w.local_rank >= w.local_size)
    throw std::invalid_argument("local rank " + std::to_string(w.local_rank) + " is outside [0, " +
                                std::to_string(w.local_size) + ")" + who);
  if (w.master_port < 1 || w.master_port > 65535)
    throw std::invalid_argument("MASTER_PORT=" + std::to_string(w.master_port) + " is not a TCP port");
  return w;
}

World detect_world() {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return detect_world(vars);
}

std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "unknown host";
  return name;
}

}  // namespace zb
