#include "observe/metrics_follower.h"

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

#include "util/fs.h"
#include "util/log.h"

extern char** environ;

namespace zb {

std::string follower_python() {
  if (const char* p = std::getenv("ZB_PYTHON"); p && *p) return p;
  return path_exists(ZB_BUILD_PYTHON) ? ZB_BUILD_PYTHON : "python3";
}

std::string run_config_path(const std::string& metrics_path) {
  struct stat st {};
  if (::stat(metrics_path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  const size_t slash = metrics_path.rfind('/'), dot = metrics_path.rfind('.');
  const bool has_extension = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  return (has_extension ? metrics_path.substr(0, dot) : metrics_path) + ".config.json";
}

bool start_metrics_follower(const Config& c, const std::string& metrics_path, bool resumed) {
  if (!c.wandb && c.logging.tensorboard_dir.empty()) return false;
  const std::string script = project_file("scripts/watch/follow_metrics.py");
  const std::string dir = parent_directory(metrics_path);
  const std::string log = (dir.empty() ? std::string(".") : dir) + "/follower.log";
  if (script.empty()) {
    log::warn("metrics follower: scripts/watch/follow_metrics.py is missing beside this program; no W&B / TensorBoard "
              "for this run");
    return false;
  }
  // sh starts the follower in the background and exits at once, so the follower is nobody's child
  // to wait for. Its output goes to the log; fd 3 is our stderr, for its warnings.
  std::vector<std::string> args = {"/bin/sh", "-c", "\"$@\" 3>&2 </dev/null >>\"$0\" 2>&1 &", log,
                                   follower_python(), script, metrics_path, "--follow",
                                   "--pid", std::to_string(getpid()), "--console-fd", "3"};
  if (c.wandb) args.push_back("--wandb");
  if (resumed) args.push_back("--resumed");
  if (!c.logging.tensorboard_dir.empty()) {
    args.push_back("--tensorboard");
    args.push_back(c.logging.tensorboard_dir);
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // Nothing of ours but stdin/stdout/stderr goes with it: an inherited socket of the collectives
  // would keep a connection open after this process died, and its peers would not see it go.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);
  pid_t pid = 0;
  const int failed = posix_spawn(&pid, "/bin/sh", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (failed != 0) {
    log::warn("metrics follower: could not start /bin/sh; no W&B / TensorBoard for this run");
    return false;
  }
  int status = 0;
  waitpid(pid, &status, 0);  // the shell only, which returns as soon as it has started it
  log::info(std::string("metrics follower: ") + (c.wandb ? "W&B" : "") +
            (c.wandb && !c.logging.tensorboard_dir.empty() ? " and " : "") +
            (c.logging.tensorboard_dir.empty() ? "" : "TensorBoard (" + c.logging.tensorboard_dir + ")") +
            " via " + follower_python() + " " + script + "; its log: " + log);
  return true;
}

}  // namespace zb
