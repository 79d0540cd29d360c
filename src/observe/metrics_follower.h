#pragma once
// Watching a run on dashboards. The binary stays free of Python: with `wandb = true` or
// `logging.tensorboard_dir` in the config, rank 0 starts scripts/watch/follow_metrics.py on its own
// metrics file, as a separate process that the run never waits for. It follows the file until the
// final step (or until this process ends) and sends every record to W&B / TensorBoard. Its output
// goes to follower.log beside the metrics; a warning (no wandb package, say) also to our stderr.
// If it cannot start, one warning and training goes on.
#include <string>

#include "config/config.h"

namespace zb {

// The Python that runs the follower: $ZB_PYTHON, else the project's environment found by the build.
std::string follower_python();

// Where the resolved run is written beside a metrics file: <stem>.config.json for <stem>.jsonl
// ("" for a metrics path that is not a regular file, such as /dev/null).
std::string run_config_path(const std::string& metrics_path);

// Starts the follower for `metrics_path` when the config asks for one (`resumed`: the run
// continues an earlier one, whose W&B run it continues); returns whether it started.
bool start_metrics_follower(const Config& c, const std::string& metrics_path, bool resumed);

}  // namespace zb
