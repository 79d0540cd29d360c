#include "dist/world.h"

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
  if (env.has("RANK") && env.has("WORLD_SIZE")) {
    w.launcher = "torchrun";
    w.rank = env.num("RANK", 0);
    w.size = env.num("WORLD_SIZE", 1);
    w.local_rank = env.num("LOCAL_RANK", w.rank);
    w.local_size = env.num("LOCAL_WORLD_SIZE", w.size);
  } else if (env.has("OMPI_COMM_WORLD_RANK")) {
    w.launcher = "OpenMPI";
    w.rank = env.num("OMPI_COMM_WORLD_RANK", 0);
    w.size = env.num("OMPI_COMM_WORLD_SIZE", 1);
    w.local_rank = env.num("OMPI_COMM_WORLD_LOCAL_RANK", w.rank);
    w.local_size = env.num("OMPI_COMM_WORLD_LOCAL_SIZE", w.size);
  } else if (env.has("PMI_RANK")) {
    w.launcher = "MPICH/PMI";
    w.rank = env.num("PMI_RANK", 0);
    w.size = env.num("PMI_SIZE", 1);
    w.local_rank = env.num("MPI_LOCALRANKID", w.rank);
    w.local_size = env.num("MPI_LOCALNRANKS", w.size);
  } else if (env.has("SLURM_PROCID")) {
    w.launcher = "SLURM";
    w.rank = env.num("SLURM_PROCID", 0);
    w.size = env.num("SLURM_NTASKS", 1);
    w.local_rank = env.num("SLURM_LOCALID", w.rank);
    w.local_size = env.num("SLURM_NTASKS_PER_NODE", w.size);
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

}  // namespace zb
