#pragma once
// The command line of the training apps:
//   train_fsdp --config FILE [--dry-run [--world-size N]] [--print-config] [--force] [--device cpu|cuda]
//              [--<dotted.key> VALUE ...]
//   train_fsdp @ FILE ...            (ZeroBand's form; also @FILE)
// Overrides: --optim.optim.lr 0.01, --train.micro_bs=4, --data.fake (true), --no-data.fake.
#include <cstdint>
#include <string>

#include "config/config.h"

namespace zb {

struct CommandLine {
  Config config;
  bool help = false;
  bool dry_run = false;
  bool print_config = false;  // the resolved run as JSON (scripts/perf/bench_peer.py reads it)
  int64_t print_plan_rank = -1;  // --print-plan [RANK]: that rank's step plan as JSON (-1: not asked)
  int64_t world_size = 0;     // --world-size: the world a dry run or plan is for (0: the launcher's)
  bool force = false;         // train even if the memory estimate says it will not fit
};

// Throws ConfigError for unknown keys, bad values or a missing/unreadable config file.
CommandLine parse_command_line(int argc, const char* const* argv);
// --help text: the options, then every config key with its type and default.
std::string help_text(const std::string& program);

}  // namespace zb
