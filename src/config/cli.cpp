#include "config/cli.h"

#include <cxxopts.hpp>

#include <cstdlib>
#include <map>
#include <sstream>

#include "config/fields.h"

namespace zb {
namespace {

cxxopts::Options make_options(const std::string& program) {
  cxxopts::Options options(program, "Pretrain a Llama-style model (zeroband-cpp)");
  const std::string devices = join_choices(find_field("runtime.device")->choices);
  options.add_options()
      ("config", "TOML config file (also: @ FILE)", cxxopts::value<std::string>())
      ("dry-run", "print sizes, FLOPs and the predicted peak memory per rank, then exit")
      ("world-size", "the number of ranks --dry-run, --print-config and --print-plan plan for (default: the launcher's)",
       cxxopts::value<int64_t>())
      ("force", "train even where the memory estimate says the run will not fit")
      ("print-config", "print the resolved run (model shapes, batch, optimizers) as JSON, then exit")
      ("print-plan", "print one step's plan (gathers, frees, collectives with their bytes) as JSON for "
                     "rank 0 of --world-size ranks (--print-plan=RANK for another), then exit",
       cxxopts::value<int64_t>()->implicit_value("0"))
      ("device", "shorthand for --runtime.device (" + devices + ")", cxxopts::value<std::string>())
      ("h,help", "print this help");
  options.allow_unrecognised_options();
  return options;
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// "-0.5", "-1e-3", "-2": a value, not an option.
bool negative_number(const std::string& s) {
  if (s.size() < 2 || s[0] != '-') return false;
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return *end == '\0';
}

}  // namespace

CommandLine parse_command_line(int argc, const char* const* argv) {
  // ZeroBand's "@ file" / "@file" becomes --config file.
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "@") {
      if (i + 1 >= argc) throw ConfigError("command line: '@' must be followed by a config file");
      args.push_back("--config");
      args.push_back(argv[++i]);
    } else if (starts_with(a, "@")) {
      args.push_back("--config");
      args.push_back(a.substr(1));
    } else if (starts_with(a, "--") && a.find('=') == std::string::npos && i + 1 < argc &&
               negative_number(argv[i + 1])) {
      args.push_back(a + "=" + argv[++i]);  // "--key -0.5": cxxopts would read "-0.5" as short options
    } else {
      args.push_back(a);
    }
  }
  std::vector<const char*> cargv{argv[0]};
  for (const auto& a : args) cargv.push_back(a.c_str());

  auto options = make_options(argv[0]);
  cxxopts::ParseResult result;
  try {
    result = options.parse(static_cast<int>(cargv.size()), cargv.data());
  } catch (const cxxopts::exceptions::exception& e) {
    throw ConfigError(std::string("command line: ") + e.what());
  }

  CommandLine cl;
  cl.help = result.count("help") > 0;
  cl.dry_run = result.count("dry-run") > 0;
  cl.print_config = result.count("print-config") > 0;
  cl.force = result.count("force") > 0;
  if (result.count("print-plan")) {
    cl.print_plan_rank = result["print-plan"].as<int64_t>();
    if (cl.print_plan_rank < 0) throw ConfigError("command line: --print-plan's rank must be at least 0");
  }
  if (result.count("world-size")) {
    cl.world_size = result["world-size"].as<int64_t>();
    if (cl.world_size < 1) throw ConfigError("command line: --world-size must be at least 1");
  }
  if (cl.help) return cl;
  if (!result.count("config"))
    throw ConfigError("command line: no config file given (use --config FILE or @ FILE)");
  cl.config = load_config_file(result["config"].as<std::string>());

  // Everything cxxopts did not know is a dotted config override, applied in order.
  const auto& rest = result.unmatched();
  for (size_t i = 0; i < rest.size(); ++i) {
    const std::string& a = rest[i];
    if (!starts_with(a, "--"))
      throw ConfigError("command line: unexpected argument '" + a + "'");
    std::string key = a.substr(2), value;
    if (auto eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else if (starts_with(key, "no-")) {
      key = key.substr(3);
      value = "false";
      // Unknown keys are apply_override's to name; a string set to "false" would be a path.
      if (const Field* f = find_field(key); f && f->kind != Kind::Bool && f->kind != Kind::BoolOrInt && f->kind != Kind::BoolOrAuto)
        throw ConfigError("command line (" + a + "): --no- is for booleans, and " + key + " is not one");
    } else if (i + 1 < rest.size() && !starts_with(rest[i + 1], "--")) {
      value = rest[++i];
    }  // else: a bare boolean flag; "" means true
    apply_override(cl.config, key, value);
  }
  if (result.count("device")) apply_override(cl.config, "runtime.device", result["device"].as<std::string>());
  return cl;
}

std::string help_text(const std::string& program) {
  std::ostringstream os;
  os << make_options(program).help();
  os << "Config keys (set in the TOML file, or override as --key VALUE; booleans also as\n"
        "--key / --no-key):\n";
  std::string section = "\n";
  for (const auto& k : config_keys()) {
    auto dot = k.key.rfind('.');
    std::string s = dot == std::string::npos ? "" : k.key.substr(0, dot);
    if (s != section) {
      os << "\n  " << (s.empty() ? "(top level)" : "[" + s + "]") << "\n";
      section = s;
    }
    std::string lhs = "    " + k.key + " (" + k.type + ", default " + k.default_value + ")";
    os << lhs << "\n        " << k.description << "\n";
  }
  return os.str();
}

}  // namespace zb
