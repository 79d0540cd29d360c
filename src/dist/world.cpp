#include "dist/world.h"

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <stdexcept>

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
    char* end = nullptr;
    const long long v = std::strtoll(it->second.c_str(), &end, 10);
    if (it->second.empty() || *end != '\0')
      throw std::invalid_argument(std::string(name) + "='" + it->second + "' is not an integer");
    return v;
  }
};

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
      {"SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  for (const Launcher& l : launchers) {
    if (!env.has(l.rank) || !env.has(l.size)) continue;
    w.launcher = l.name;
    w.rank = env.num(l.rank, 0);
    w.size = env.num(l.size, 1);
    w.local_rank = env.num(l.local_rank, w.rank);
    w.local_size = env.num(l.local_size, w.size);
    break;
  }
  w.master_addr = env.str("MASTER_ADDR", w.master_addr);
  w.master_port = env.num("MASTER_PORT", w.master_port);

  const std::string who = " (from " + w.launcher + ")";
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
