// Configuration: ZeroBand files load unchanged, overrides, and every error path names the key and
// where it came from.
#include <gtest/gtest.h>

#include <string>

#include "config/cli.h"
#include "config/config.h"
#include "config/model_config.h"
#include "config/resolved_run.h"

using namespace zb;

namespace {

const std::string kConfigs = std::string(ZB_SOURCE_DIR) + "/configs/";

// Runs `fn` and returns the ConfigError message; fails the test when nothing is thrown.
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

CommandLine parse(std::vector<std::string> args) {
  std::vector<const char*> argv{"train_fsdp"};
  for (const auto& a : args) argv.push_back(a.c_str());
  return parse_command_line(static_cast<int>(argv.size()), argv.data());
}

const char* kMinimal = "[train]\nmicro_bs = 2\n";

}  // namespace

TEST(ConfigPresets, DebugNormalIsZeroBands) {
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  EXPECT_EQ(c.name_model, "debugmodel");
  EXPECT_EQ(c.type_model, "llama2");
  EXPECT_FALSE(c.wandb);
  EXPECT_EQ(c.train.micro_bs, 8);
  EXPECT_EQ(c.optim.batch_size, 16);
  EXPECT_EQ(c.optim.warmup_steps, 10);
  EXPECT_EQ(c.optim.total_steps, 4);
  EXPECT_TRUE(c.data.fake);
  EXPECT_EQ(c.data.seq_length, 1024);
  EXPECT_DOUBLE_EQ(c.optim.optim.lr, 0.02);
  EXPECT_NO_THROW(validate(c, 1));
  EXPECT_NO_THROW(validate(c, 2));
  EXPECT_EQ(resolve_model_args(c).vocab_size, 1024);
}

TEST(ConfigPresets, OneBIsZeroBands) {
  Config c = load_config_file(kConfigs + "1B/H100.toml");
  ModelArgs a = resolve_model_args(c);
  EXPECT_EQ(a.dim, 2048);
  EXPECT_EQ(a.n_layers, 18);
  EXPECT_EQ(a.n_heads, 16);
  EXPECT_EQ(a.ffn_hidden(), 5632);
  EXPECT_EQ(a.vocab_size, 32000);
  EXPECT_EQ(c.data.seq_length, 1024);
  EXPECT_EQ(c.optim.batch_size, 1024);
  EXPECT_EQ(c.train.micro_bs, 32);
  EXPECT_EQ(c.optim.warmup_steps, 1000);
  EXPECT_EQ(c.optim.total_steps, 8192);
  EXPECT_DOUBLE_EQ(c.optim.optim.lr, 7e-4);
  EXPECT_TRUE(c.train.reshard_after_forward);
  EXPECT_NO_THROW(validate(c, 8));
  EXPECT_EQ(grad_accum_steps(c, 8), 4);
}

TEST(ConfigPresets, OneFiftyMAndSevenBLoad) {
  Config m = load_config_file(kConfigs + "150M/H100.toml");
  EXPECT_EQ(m.train.micro_bs, 64);
  EXPECT_FALSE(m.train.reshard_after_forward);
  EXPECT_EQ(m.optim.total_steps, 88000);  // written 88_000
  EXPECT_DOUBLE_EQ(m.optim.optim.lr, 4e-4);
  EXPECT_NO_THROW(validate(m, 8));
  Config b = load_config_file(kConfigs + "7B/H100.toml");
  EXPECT_EQ(b.data.seq_length, 2048);
  EXPECT_EQ(b.train.micro_bs, 4);
  EXPECT_DOUBLE_EQ(b.optim.optim.lr, 3e-4);
  EXPECT_NO_THROW(validate(b, 8));
  EXPECT_EQ(grad_accum_steps(b, 8), 32);
}

TEST(ConfigPresets, EveryZeroBandKeyIsAccepted) {
  // All of ZeroBand's keys, including those that mean nothing here (wandb, torch_compile).
  const char* text = R"(
name_model = "150M"
type_model = "llama3"
project = "p"
wandb = true
[train]
micro_bs = 4
ac_ckpt = 2
reshard_after_forward = false
torch_compile = true
[optim]
sched_type = "wsd-sqrt"
warmup_steps = 10
stable_steps = 20
total_steps = 30
batch_size = 64
[optim.optim]
type = "muon"
lr = 1e-3
wd = 0.1
momentum = 0.9
ns_steps = 6
[data]
dataset_name_or_paths = "a,b"
val_dataset_name_or_paths = "v"
seq_length = 512
fake = false
num_workers = 1
max_train_samples = 5
max_eval_samples = 6
dataset_ratio = "70:30"
data_rank = 0
data_world_size = 1
reverse_data_files = true
split_by_data_rank = false
)";
  Config c = load_config_string(text, "zb.toml");
  EXPECT_EQ(c.train.ac_ckpt, 2);
  EXPECT_EQ(c.optim.optim.ns_steps, 6);
  EXPECT_EQ(*c.data.dataset_ratio, "70:30");
  EXPECT_EQ(*c.data.max_eval_samples, 6);
  EXPECT_TRUE(c.data.reverse_data_files);
  // 150M exists only in the llama2 table.
  EXPECT_NE(error_of([&] { validate(c, 1); }).find("unknown name_model '150M' for type_model 'llama3'"),
            std::string::npos);
}

TEST(ConfigErrors, UnknownKeyNamesFileLineAndSuggestion) {
  auto msg = error_of([] { load_config_string("[train]\nmicro_bs = 2\nmicro_bz = 3\n", "x.toml"); });
  EXPECT_EQ(msg, "x.toml:3: unknown key 'train.micro_bz' (did you mean 'train.micro_bs'?)");
}

TEST(ConfigErrors, ZeroBandLeftoverKeysAreRejected) {
  // ZeroBand's own validator rejects these too (150M/H100-fast.toml).
  auto msg = error_of([] { load_config_string("[train]\n[optim.optim]\nbetas1 = 0.9\n", "fast.toml"); });
  EXPECT_NE(msg.find("fast.toml:3: unknown key 'optim.optim.betas1'"), std::string::npos) << msg;
}

TEST(ConfigErrors, UnknownSection) {
  auto msg = error_of([] { load_config_string("[train]\n[trian]\nx = 1\n", "x.toml"); });
  EXPECT_EQ(msg, "x.toml:2: unknown section [trian] (did you mean 'train'?)");
}

TEST(ConfigErrors, WrongType) {
  auto msg = error_of([] { load_config_string("[train]\nmicro_bs = \"8\"\n", "x.toml"); });
  EXPECT_EQ(msg, "x.toml:2: key 'train.micro_bs' must be an integer, got string");
  msg = error_of([] { load_config_string("[train]\nmicro_bs = 2.5\n", "x.toml"); });
  EXPECT_EQ(msg, "x.toml:2: key 'train.micro_bs' must be an integer, got floating-point");
  msg = error_of([] { load_config_string("wandb = 1\n[train]\n", "x.toml"); });
  EXPECT_EQ(msg, "x.toml:1: key 'wandb' must be a boolean, got integer");
  // An integer where a number is expected is fine.
  Config c = load_config_string("[train]\n[optim.optim]\nlr = 1\n", "x.toml");
  EXPECT_DOUBLE_EQ(c.optim.optim.lr, 1.0);
}

TEST(ConfigErrors, UnknownFusedOperatorIsNamed) {
  // runtime.unfused takes our fused operators' names; a typo names the key, its line and the known.
  const std::string model = "name_model = \"debugmodel\"\ntype_model = \"llama2\"\n";
  Config ok = load_config_string(model + "[train]\n[runtime]\nunfused = \"norm, linears\"\n", "x.toml");
  EXPECT_NO_THROW(validate(ok, 1));
  Config c = load_config_string(model + "[train]\n[runtime]\nunfused = \"norm,linear\"\n", "x.toml");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "x.toml:5: runtime.unfused names 'linear', not one of rope, gate, loss, norm, linears, update, "
            "momentum, residual, newton_schulz");
}

TEST(ConfigErrors, FakeDataNeedsFourTokens) {
  Config c = load_config_file(kConfigs + "debug/normal.toml");  // fake data
  apply_override(c, "model.vocab_size", "3");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--model.vocab_size): data.fake needs a vocabulary of at least 4 tokens, got 3");
}

TEST(ConfigErrors, MissingTrainSection) {
  auto msg = error_of([] { load_config_string("name_model = \"1B\"\n", "x.toml"); });
  EXPECT_EQ(msg, "x.toml: missing required section [train]");
}

TEST(ConfigErrors, NotToml) {
  auto msg = error_of([] { load_config_string("[train]\nmicro_bs = = 2\n", "x.toml"); });
  EXPECT_EQ(msg.rfind("x.toml:2: not valid TOML", 0), 0u) << msg;
}

TEST(ConfigErrors, MissingFile) {
  auto msg = error_of([] { load_config_file("/nonexistent/cfg.toml"); });
  EXPECT_EQ(msg, "/nonexistent/cfg.toml: cannot open config file");
}

TEST(ConfigErrors, ImpossibleCombinations) {
  auto check = [](const std::string& text, int64_t world, const std::string& expected) {
    Config c = load_config_string(text, "x.toml");
    auto msg = error_of([&] { validate(c, world); });
    EXPECT_EQ(msg, expected) << text;
  };
  const std::string debug = "name_model = \"debugmodel\"\ntype_model = \"llama2\"\n";
  check(debug + "[train]\nmicro_bs = 3\n[optim]\nbatch_size = 16\n", 1,
        "x.toml:6: optim.batch_size (16) must be divisible by world size (1) x train.micro_bs (3)");
  check(debug + "[train]\nmicro_bs = 2\n[optim]\nbatch_size = 16\n", 3,
        "x.toml:6: optim.batch_size (16) must be divisible by world size (3) x train.micro_bs (2)");
  check(debug + "[model]\nn_heads = 7\n[train]\n", 1,
        "x.toml:4: n_heads (7) must divide dim (256)");
  check(debug + "[model]\nn_kv_heads = 3\n[train]\n", 1,
        "x.toml:4: n_kv_heads (3) must divide n_heads (8)");
  check(debug + "[model]\ndim = 264\n[train]\n", 1,
        "x.toml:4: head dimension dim/n_heads = 33 must be even for rotary embeddings");
  check(debug + "[train]\nmicro_bs = 0\n", 1, "x.toml:4: train.micro_bs must be > 0, got 0");
  check(debug + "[train]\n[profiling]\nprofile_freq = 2\nprofile_active = 3\n", 1,
        "x.toml:6: profiling.profile_active (3) must not exceed profiling.profile_freq (2)");
  check(debug + "[train]\n[profiling]\nenable_profiling = true\nnvtx = true\n", 1,
        "x.toml:6: profiling.nvtx and profiling.enable_profiling are two uses of the one profiler of a process: "
        "choose one (nvtx for Nsight Systems, enable_profiling for traces)");
  check(debug + "[train]\n[optim]\nsched_type = \"cosin\"\n", 1,
        "x.toml:5: optim.sched_type = \"cosin\" is not one of cosine | linear | wsd-sqrt");
  check(debug + "[train]\n[optim]\nsched_type = \"wsd-sqrt\"\nwarmup_steps = 10\nstable_steps = 5\ntotal_steps = 20\n",
        1, "x.toml:7: wsd-sqrt needs warmup_steps (10) <= stable_steps (5) <= total_steps (20)");
  check(debug + "[train]\n[optim.optim]\ntype = \"sgd\"\n", 1,
        "x.toml:5: optim.optim.type = \"sgd\" is not one of muon | adamw");
  check(debug + "[train]\n[optim.optim]\nmomentum = 1.0\n", 1,
        "x.toml:5: optim.optim.momentum must be in [0, 1), got 1");
  check(debug + "[train]\n[optim.optim]\nupdate_scale = \"spectral\"\n", 1,
        "x.toml:5: optim.optim.update_scale = \"spectral\" is not one of original | match_rms_adamw");
  check(debug + "[train]\n[optim.adam]\nbetas2 = 1.5\n", 1,
        "x.toml:5: optim.adam.betas2 must be in [0, 1), got 1.5");
  check(debug + "[train]\n[optim.adam]\neps = 0\n", 1, "x.toml:5: optim.adam.eps must be > 0, got 0");
  check(debug + "[train]\n[runtime]\ndevice = \"tpu\"\n", 1,
        "x.toml:5: runtime.device = \"tpu\" is not one of auto | cpu | cuda");
  check("name_model = \"3B\"\ntype_model = \"llama2\"\n[train]\n", 1,
        "x.toml:1: unknown name_model '3B' for type_model 'llama2' (known: 10B, 13B, 150M, 1B, "
        "26B, 271M, 70B, 70M, 7B, debugmodel)");
  check("type_model = \"llama4\"\n[train]\n", 1,
        "x.toml:1: type_model = \"llama4\" is not one of llama2 | llama3");
  // A default value that becomes impossible names the key as a default.
  check(debug + "[train]\nmicro_bs = 1\n", 0, "world size must be >= 1, got 0");
}

TEST(ConfigErrors, DatasetRatioMatchesThePaths) {
  const std::string two = "name_model = \"debugmodel\"\ntype_model = \"llama2\"\n[train]\n[data]\n"
                          "dataset_name_or_paths = \"a,b\"\n";
  auto with_ratio = [&](const std::string& ratio) {
    return load_config_string(two + "dataset_ratio = \"" + ratio + "\"\n", "x.toml");
  };
  EXPECT_NO_THROW(validate(with_ratio("70:30"), 1));
  EXPECT_EQ(error_of([&] { validate(with_ratio("1:1:1"), 1); }),
            "x.toml:6: dataset_ratio \"1:1:1\" has 3 parts for 2 datasets");
  EXPECT_EQ(error_of([&] { validate(with_ratio("70:x"), 1); }),
            "x.toml:6: dataset_ratio \"70:x\": 'x' is not a positive number");
  EXPECT_EQ(error_of([&] { validate(with_ratio("inf:1"), 1); }),
            "x.toml:6: dataset_ratio \"inf:1\": 'inf' is not a positive number");
  // From the command line, the origin is the override.
  Config c = load_config_string(two, "x.toml");
  apply_override(c, "data.dataset_ratio", "70");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--data.dataset_ratio): dataset_ratio \"70\" has 1 parts for 2 datasets");
  // Fake data reads no datasets, so neither their ratio (as the trainer does).
  apply_override(c, "data.fake", "true");
  EXPECT_NO_THROW(validate(c, 1));
}

TEST(ConfigErrors, NumbersMustBeFinite) {
  // TOML's inf and nan literals, and the same words on the command line, for every kind of float
  // key: refused where they are read, naming the key and its origin.
  for (const char* literal : {"inf", "-inf", "nan", "+inf"}) {
    const std::string toml = std::string("[train]\nmicro_bs = 2\n[optim.optim]\nlr = ") + literal + "\n";
    EXPECT_EQ(error_of([&] { load_config_string(toml, "x.toml"); }),
              std::string("x.toml:4: key 'optim.optim.lr' must be a finite number, got ") +
                  (std::string(literal) == "+inf" ? "inf" : literal))
        << literal;
  }
  Config c = load_config_string(kMinimal, "x.toml");
  for (const char* key : {"optim.adam.eps", "optim.max_norm", "runtime.peak_flops", "model.rope_theta"})
    for (const char* text : {"inf", "nan", "-inf", "1e999"})
      EXPECT_EQ(error_of([&] { apply_override(c, key, text); }),
                std::string("command line (--") + key + "): key '" + key + "' must be a finite number, got " +
                    (std::string(text) == "1e999" ? "inf" : text))
          << key << " " << text;
  // Text that is no number at all keeps its own message.
  EXPECT_EQ(error_of([&] { apply_override(c, "optim.optim.lr", "fast"); }),
            "command line (--optim.optim.lr): key 'optim.optim.lr' must be a number, got 'fast'");
}

TEST(ConfigErrors, NumbersMustBeInRange) {
  // Learning rates > 0, betas in [0, 1), eps > 0, weight decay and clipping >= 0.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"optim.optim.lr", "0"},          {"optim.adam.lr_embedding", "0"}, {"optim.adam.lr_head", "-1"},
      {"optim.adam.lr_norm", "0"},      {"optim.adam.betas1", "1"},       {"optim.adam.betas2", "-0.1"},
      {"optim.adam.eps", "0"},          {"optim.adam.wd", "-0.01"},       {"optim.optim.wd", "-1"},
      {"optim.max_norm", "-1"},         {"runtime.peak_flops", "-1"},     {"optim.optim.momentum", "1"},
      {"model.ffn_dim_multiplier", "-1"}, {"train.bucket_mb", "0"}};
  const std::string base = "name_model = \"debugmodel\"\ntype_model = \"llama2\"\n[train]\nmicro_bs = 2\n";
  for (const auto& [key, value] : cases) {
    Config c = load_config_string(base, "x.toml");
    apply_override(c, key, value);
    const std::string msg = error_of([&] { validate(c, 1); });
    EXPECT_EQ(msg.rfind("command line (--" + key + "): " + key + " must be ", 0), 0u) << msg;
  }
  // From a file, the line is named.
  Config c = load_config_string(base + "[optim.adam]\nbetas1 = 1.5\n", "x.toml");
  EXPECT_EQ(error_of([&] { validate(c, 1); }), "x.toml:6: optim.adam.betas1 must be in [0, 1), got 1.5");
}

TEST(ConfigErrors, EnumerationsComeFromTheSchema) {
  // Every enumerated key: its --help type lists the same choices validation accepts.
  int enumerations = 0;
  for (const auto& k : config_keys()) {
    if (k.type.rfind("one of ", 0) != 0) continue;
    ++enumerations;
    Config c = load_config_string(kMinimal, "x.toml");
    apply_override(c, k.key, "bogus");
    EXPECT_EQ(error_of([&] { validate(c, 1); }), "command line (--" + k.key + "): " + k.key +
                                                     " = \"bogus\" is not one of " + k.type.substr(7));
  }
  EXPECT_EQ(enumerations, 22);  // optim.optim.ns_algorithm the latest
  EXPECT_NE(help_text("train_fsdp").find("type_model (one of llama2 | llama3, default \"llama3\")"),
            std::string::npos);
}

TEST(CommandLine, OverridesInOrderAndForms) {
  CommandLine cl = parse({"--config", kConfigs + "debug/normal.toml", "--optim.optim.lr", "0.01",
                          "--train.micro_bs=4", "--no-data.fake", "--train.ac_ckpt", "true",
                          "--wandb", "--optim.total_steps", "1_000", "--device", "cpu"});
  EXPECT_DOUBLE_EQ(cl.config.optim.optim.lr, 0.01);
  EXPECT_EQ(cl.config.train.micro_bs, 4);
  EXPECT_FALSE(cl.config.data.fake);
  EXPECT_EQ(cl.config.train.ac_ckpt, 1);
  EXPECT_TRUE(cl.config.wandb);
  EXPECT_EQ(cl.config.optim.total_steps, 1000);
  EXPECT_EQ(cl.config.runtime.device, "cpu");
  EXPECT_EQ(cl.config.origin("train.micro_bs"), "command line (--train.micro_bs)");
  // Negative numbers as values, not as short options.
  const std::string cfg = kConfigs + "debug/normal.toml";
  EXPECT_DOUBLE_EQ(parse({"--config", cfg, "--optim.optim.lr", "-1e-3"}).config.optim.optim.lr, -1e-3);
  EXPECT_DOUBLE_EQ(parse({"--config", cfg, "--optim.optim.lr", "-0.5"}).config.optim.optim.lr, -0.5);
  EXPECT_EQ(parse({"--config", cfg, "--optim.total_steps", "-2"}).config.optim.total_steps, -2);
}

TEST(Config, ReduceEveryMicroBatchIsABooleanOrAuto) {
  EXPECT_EQ(Config().train.reduce_every_micro_batch, "auto");
  EXPECT_EQ(load_config_string("[train]\nreduce_every_micro_batch = true\n", "t").train.reduce_every_micro_batch, "true");
  EXPECT_EQ(load_config_string("[train]\nreduce_every_micro_batch = \"auto\"\n", "t").train.reduce_every_micro_batch, "auto");
  EXPECT_EQ(error_of([] { load_config_string("[train]\nreduce_every_micro_batch = \"often\"\n", "t"); }),
            "t:2: key 'train.reduce_every_micro_batch' must be a boolean or \"auto\", got string");
  const std::string cfg = kConfigs + "debug/normal.toml";
  EXPECT_EQ(parse({"--config", cfg, "--train.reduce_every_micro_batch", "false"}).config.train.reduce_every_micro_batch, "false");
  EXPECT_EQ(parse({"--config", cfg, "--train.reduce_every_micro_batch=auto"}).config.train.reduce_every_micro_batch, "auto");
  EXPECT_EQ(error_of([&] { parse({"--config", cfg, "--train.reduce_every_micro_batch", "2"}); }),
            "command line (--train.reduce_every_micro_batch): key 'train.reduce_every_micro_batch' must be a "
            "boolean or \"auto\", got '2'");
}

TEST(CommandLine, ZeroBandAtForm) {
  CommandLine a = parse({"@", kConfigs + "1B/H100.toml"});
  EXPECT_EQ(a.config.name_model, "1B");
  CommandLine b = parse({"@" + kConfigs + "1B/H100.toml", "--dry-run"});
  EXPECT_EQ(b.config.name_model, "1B");
  EXPECT_TRUE(b.dry_run);
}

TEST(CommandLine, Errors) {
  const std::string cfg = kConfigs + "debug/normal.toml";
  EXPECT_EQ(error_of([&] { parse({"--config", cfg, "--train.micro_bs", "four"}); }),
            "command line (--train.micro_bs): key 'train.micro_bs' must be an integer, got 'four'");
  EXPECT_EQ(error_of([&] { parse({"--config", cfg, "--data.fake", "maybe"}); }),
            "command line (--data.fake): key 'data.fake' must be a boolean, got 'maybe'");
  EXPECT_EQ(error_of([&] { parse({"--config", cfg, "--optim.optim.lr", "fast"}); }),
            "command line (--optim.optim.lr): key 'optim.optim.lr' must be a number, got 'fast'");
  EXPECT_EQ(error_of([&] { parse({"--config", cfg, "--train.microbs", "2"}); }),
            "command line: unknown key 'train.microbs' (did you mean 'train.micro_bs'?)");
  EXPECT_EQ(error_of([&] { parse({"--dry-run"}); }),
            "command line: no config file given (use --config FILE or @ FILE)");
  EXPECT_EQ(error_of([&] { parse({"--config", cfg, "stray"}); }),
            "command line: unexpected argument 'stray'");
  // --no- sets false: for a string it would be a path named "false".
  EXPECT_EQ(error_of([&] { parse({"--config", cfg, "--no-ckpt.path"}); }),
            "command line (--no-ckpt.path): --no- is for booleans, and ckpt.path is not one");
}

TEST(CommandLine, HelpListsEveryKey) {
  const std::string help = help_text("train_fsdp");
  for (const auto& k : config_keys()) EXPECT_NE(help.find(k.key), std::string::npos) << k.key;
  EXPECT_TRUE(parse({"--help"}).help);
}

// parallel.cp: the product with the other dimensions, rows that divide into two chunks per rank
// and shares that divide over the TP group, each naming the key.
TEST(ConfigErrors, ElasticReplicas) {
  Config c = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n" + std::string(kMinimal), "x.toml");
  apply_override(c, "diloco.join", "true");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--diloco.join): diloco.join is set but diloco.inner_steps is 0 (DiLoCo off): set "
            "inner_steps to turn it on");
  apply_override(c, "diloco.inner_steps", "4");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--diloco.join): diloco.join is for elastic replicas: set diloco.peers");
  apply_override(c, "diloco.peers", "node7:29600");
  EXPECT_NO_THROW(validate(c, 2));
  for (const char* bad : {"node7", ":29600", "node7:", "node7:port", "node7:70000"}) {
    apply_override(c, "diloco.peers", bad);
    EXPECT_EQ(error_of([&] { validate(c, 2); }), std::string("command line (--diloco.peers): diloco.peers must be "
                                                             "\"host:port\" (where diloco_peers serves), got \"") +
                                                     bad + "\"");
  }
  apply_override(c, "diloco.peers", "10.0.0.1:29600");
  apply_override(c, "parallel.dp_replicate", "2");
  EXPECT_EQ(error_of([&] { validate(c, 2); }),
            "command line (--parallel.dp_replicate): with diloco.peers each launch is one replica: "
            "parallel.dp_replicate must be 1, got 2 (start one launch per replica)");
  apply_override(c, "parallel.dp_replicate", "1");
  apply_override(c, "diloco.fragments", "2");
  EXPECT_EQ(error_of([&] { validate(c, 2); }),
            "command line (--diloco.fragments): elastic replicas (diloco.peers) take whole outer steps: "
            "diloco.fragments must be 1");
  apply_override(c, "diloco.fragments", "1");
  apply_override(c, "diloco.fragment_delay", "1");
  EXPECT_EQ(error_of([&] { validate(c, 2); }),
            "command line (--diloco.fragment_delay): elastic replicas (diloco.peers) apply each outer step in "
            "its own round: diloco.fragment_delay must be 0");
  apply_override(c, "diloco.fragment_delay", "0");
  apply_override(c, "ckpt.path", "checkpoints");
  apply_override(c, "ckpt.resume", "latest");  // a resumed replica: with others resumed, or as a joiner
  EXPECT_NO_THROW(validate(c, 2));
}

TEST(ConfigErrors, ContextParallelLayouts) {
  Config c = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n" + std::string(kMinimal), "x.toml");
  c.optim.batch_size = 8;
  c.data.seq_length = 64;
  apply_override(c, "parallel.cp", "2");
  EXPECT_NO_THROW(validate(c, 4));  // cp 2 x dp_shard 2
  EXPECT_EQ(data_parallel_size(c, 4), 2);
  EXPECT_EQ(resolved_dp_shard(c, 4), 2);
  EXPECT_EQ(error_of([&] { validate(c, 3); }),
            "command line (--parallel.cp): parallel.cp (2) x parallel.tp (1) must divide the world size (3)");
  c.data.seq_length = 62;
  EXPECT_EQ(error_of([&] { validate(c, 4); }),
            "command line (--parallel.cp): parallel.cp (2): data.seq_length (62) must divide into 2 x cp chunks, two "
            "for each rank of a CP group");
  c.data.seq_length = 64;
  apply_override(c, "parallel.tp", "2");
  EXPECT_NO_THROW(validate(c, 4));  // cp 2 x tp 2: 32 tokens a rank, 16 in its residual stream
  c.data.seq_length = 18;
  apply_override(c, "parallel.cp", "3");
  apply_override(c, "parallel.tp", "4");
  EXPECT_EQ(error_of([&] { validate(c, 12); }),
            "command line (--parallel.cp): parallel.cp (3) x parallel.tp (4): a rank's share of a row (6 tokens) must "
            "divide over the TP group");
  c.data.seq_length = 64;
  apply_override(c, "parallel.cp", "2");
  apply_override(c, "parallel.tp", "1");
  apply_override(c, "diloco.inner_steps", "4");
  apply_override(c, "parallel.dp_replicate", "2");
  EXPECT_NO_THROW(validate(c, 4));  // DiLoCo's 2 replicas, each a CP group of 2
}

TEST(ConfigErrors, Float8) {
  Config c = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n" + std::string(kMinimal) +
                                    "[float8]\nrecipe_name = \"rowwise\"\nfilter_fqns = [\"output\", \"w2\"]\n",
                                "x.toml");
  EXPECT_EQ(c.float8.filter_fqns, (std::vector<std::string>{"output", "w2"}));
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "x.toml:7: float8.filter_fqns is set but float8.enable_float8_linear is false: set it to train with FP8 "
            "linears");
  apply_override(c, "float8.enable_float8_linear", "true");
  apply_override(c, "runtime.device", "cpu");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--float8.enable_float8_linear): float8.enable_float8_linear needs a GPU with FP8 tensor "
            "cores, but runtime.device = \"cpu\" (float8.emulate = true computes the same values in fp32 on any "
            "device, for tests)");
  apply_override(c, "runtime.device", "cuda");
  apply_override(c, "runtime.compute_dtype", "float32");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--float8.enable_float8_linear): float8.enable_float8_linear writes its products in "
            "bfloat16, but runtime.compute_dtype = \"float32\" (use bfloat16 or auto, or float8.emulate = true)");
  apply_override(c, "float8.emulate", "true");
  EXPECT_NO_THROW(validate(c, 1));
  apply_override(c, "float8.enable_fsdp_float8_all_gather", "true");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--float8.enable_fsdp_float8_all_gather): float8.enable_fsdp_float8_all_gather casts each "
            "weight with one scale: it needs float8.recipe_name = \"tensorwise\", not \"rowwise\"");
  apply_override(c, "float8.recipe_name", "tensorwise");
  EXPECT_NO_THROW(validate(c, 1));
  // torchtitan's precomputed scales: what the FP8 gather always does; false is refused.
  apply_override(c, "float8.precompute_float8_dynamic_scale_for_fsdp", "true");
  EXPECT_NO_THROW(validate(c, 1));
  apply_override(c, "float8.precompute_float8_dynamic_scale_for_fsdp", "false");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--float8.precompute_float8_dynamic_scale_for_fsdp): "
            "float8.precompute_float8_dynamic_scale_for_fsdp = false is not offered: the FP8 all-gather always "
            "computes the whole model's scales in one collective a step, the same scales as weight by weight (leave "
            "it out, or true)");
  apply_override(c, "float8.precompute_float8_dynamic_scale_for_fsdp", "true");
  apply_override(c, "float8.enable_fsdp_float8_all_gather", "false");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--float8.precompute_float8_dynamic_scale_for_fsdp): "
            "float8.precompute_float8_dynamic_scale_for_fsdp is about the FP8 all-gather's scales, but "
            "float8.enable_fsdp_float8_all_gather is false");
  apply_override(c, "float8.enable_fsdp_float8_all_gather", "true");
  apply_override(c, "float8.recipe_name", "blockwise");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--float8.recipe_name): float8.recipe_name = \"blockwise\" is not one of tensorwise | "
            "rowwise | rowwise_with_gw_hp");
  // On the command line a list is comma-separated names.
  apply_override(c, "float8.filter_fqns", "layers.0., w2");
  EXPECT_EQ(c.float8.filter_fqns, (std::vector<std::string>{"layers.0.", "w2"}));
  EXPECT_EQ(error_of([] { load_config_string(std::string(kMinimal) + "[float8]\nfilter_fqns = \"output\"\n", "y.toml"); }),
            "y.toml:4: key 'float8.filter_fqns' must be a list of strings, got string");
}

TEST(ConfigErrors, CpVarlenNeedsCpAllgatherOnAGpu) {
  Config c = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n" + std::string(kMinimal), "x.toml");
  apply_override(c, "runtime.cp_varlen", "true");
  const std::string refused = "command line (--runtime.cp_varlen): runtime.cp_varlen is context parallelism's "
                              "variable-length kernel: it needs parallel.cp above 1, parallel.cp_rotate = "
                              "\"allgather\" and a GPU";
  EXPECT_EQ(error_of([&] { validate(c, 2); }), refused);
  apply_override(c, "parallel.cp", "2");
  apply_override(c, "runtime.device", "cuda");
  EXPECT_NO_THROW(validate(c, 2));
  apply_override(c, "parallel.cp_rotate", "ring");
  EXPECT_EQ(error_of([&] { validate(c, 2); }), refused);
  apply_override(c, "parallel.cp_rotate", "allgather");
  apply_override(c, "runtime.device", "cpu");
  EXPECT_EQ(error_of([&] { validate(c, 2); }), refused);
}

TEST(ResolvedRun, DecidesTheMeshAttentionAndStepOnce) {
  // The debug preset on 8 CPU ranks: 2 replicas x dp_shard -1 (the rest: 2) x cp 2, rows in
  // documents. Without the flash kernels attention reads a mask; the micro-batches are the batch
  // over the 4 data-parallel ranks' micro-batches.
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  c.parallel.dp_replicate = 2;
  c.parallel.cp = 2;
  c.optim.batch_size = 32;
  c.train.micro_bs = 2;
  validate(c, 8);
  ResolvedRun r = resolve_run(c, 8, EngineKind::Sharded, c10::Device(c10::kCPU));
  EXPECT_EQ(r.mesh.dp_shard_cp, 4);
  EXPECT_EQ(r.mesh.data_parallel_size(), 4);
  EXPECT_EQ(data_parallel_size(c, 8), r.mesh.data_parallel_size());
  EXPECT_EQ(r.micro_batches, 32 / (4 * 2));
  EXPECT_EQ(r.compute_dtype, at::kFloat);
  EXPECT_FALSE(r.attention.flash_documents);
  EXPECT_TRUE(r.attention.mask());
  EXPECT_FALSE(r.attention.cp_ring());
  c.parallel.cp_rotate = "ring";
  EXPECT_TRUE(resolve_run(c, 8, EngineKind::Sharded, c10::Device(c10::kCPU)).attention.cp_ring());
  // The replicating engine: every rank a replica, whatever the shard keys say.
  c.parallel.cp = 1;
  EXPECT_EQ(resolve_run(c, 8, EngineKind::Replicated, c10::Device(c10::kCPU)).mesh.replicate, 8);
  // Causal attention over whole rows on one rank: no mask at all.
  c.model.attention = "causal";
  EXPECT_FALSE(resolve_attention(c, 1, c10::Device(c10::kCPU), at::kFloat).mask());
  // runtime.cp_varlen where the flash kernels cannot run: refused, named.
  c.parallel.cp = 2;
  c.parallel.cp_rotate = "allgather";
  c.runtime.cp_varlen = true;
  EXPECT_NE(error_of([&] { resolve_attention(c, 2, c10::Device(c10::kCPU), at::kFloat); })
                .find("runtime.cp_varlen needs the variable-length flash kernel"),
            std::string::npos);
}

TEST(ResolvedRun, SettlesAutoAsTheMemoryVerdictSays) {
  // One rank, four micro-batches: per-micro-batch reduction and kept casts can both apply.
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  c.optim.batch_size = 4 * c.train.micro_bs;
  c.parallel.dp_shard = 1;
  validate(c, 1);
  const c10::Device cpu(c10::kCPU);
  c.train.reduce_every_micro_batch = "auto";
  c.train.keep_unsharded = "auto";
  ResolvedRun off = resolve_run(c, 1, EngineKind::Sharded, cpu);
  EXPECT_FALSE(off.reduce_every_micro_batch || off.keep_unsharded);  // no verdict: "auto" is off
  ResolvedRun on = resolve_run(c, 1, EngineKind::Sharded, cpu, {true, true});
  EXPECT_TRUE(on.reduce_every_micro_batch && on.keep_unsharded);
  // Set, the config wins over the verdict.
  c.train.reduce_every_micro_batch = "false";
  c.train.keep_unsharded = "false";
  on = resolve_run(c, 1, EngineKind::Sharded, cpu, {true, true});
  EXPECT_FALSE(on.reduce_every_micro_batch || on.keep_unsharded);
  c.train.reduce_every_micro_batch = "true";
  c.train.keep_unsharded = "true";
  EXPECT_TRUE(resolve_run(c, 1, EngineKind::Sharded, cpu).reduce_every_micro_batch);
  EXPECT_TRUE(resolve_run(c, 1, EngineKind::Sharded, cpu).keep_unsharded);
  // Where they cannot apply: one micro-batch has nothing to reduce early; the replicating engine
  // keeps no casts, nor does a shard group of two ranks.
  Config one = c;
  one.optim.batch_size = one.train.micro_bs;
  EXPECT_FALSE(resolve_run(one, 1, EngineKind::Sharded, cpu).reduce_every_micro_batch);
  EXPECT_FALSE(resolve_run(c, 1, EngineKind::Replicated, cpu).keep_unsharded);
  Config two = c;
  two.parallel.dp_shard = -1;
  two.optim.batch_size = 8 * two.train.micro_bs;
  validate(two, 2);
  EXPECT_FALSE(resolve_run(two, 2, EngineKind::Sharded, cpu).keep_unsharded);
}

TEST(ConfigErrors, MixtureOfExperts) {
  Config c = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n" + std::string(kMinimal), "x.toml");
  c.optim.batch_size = 8;
  apply_override(c, "model.num_experts", "8");
  apply_override(c, "model.top_k", "2");
  EXPECT_NO_THROW(validate(c, 1));
  apply_override(c, "model.top_k", "9");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--model.top_k): model.top_k (9) must be between 1 and model.num_experts (8)");
  apply_override(c, "model.top_k", "2");
  apply_override(c, "model.num_expert_groups", "3");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--model.num_expert_groups): model.num_expert_groups (3) must divide model.num_experts (8)");
  apply_override(c, "model.num_expert_groups", "4");
  apply_override(c, "model.num_limited_groups", "5");
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--model.num_limited_groups): model.num_limited_groups (5) must be between 1 and "
            "model.num_expert_groups (4)");
  apply_override(c, "model.num_limited_groups", "1");
  apply_override(c, "model.top_k", "3");  // one group of 2 experts cannot give 3
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--model.top_k): model.top_k (3) is more than the 2 experts of the model.num_limited_groups "
            "(1) groups a token chooses in");
  apply_override(c, "model.top_k", "2");
  EXPECT_NO_THROW(validate(c, 1));
  apply_override(c, "model.n_dense_layers", "2");  // debugmodel has 2 blocks
  EXPECT_EQ(error_of([&] { validate(c, 1); }),
            "command line (--model.n_dense_layers): model.n_dense_layers (2) must leave at least one of the 2 blocks a "
            "mixture of experts");
  apply_override(c, "model.n_dense_layers", "1");
  apply_override(c, "parallel.tp", "2");  // the routed experts whole on every TP rank
  EXPECT_NO_THROW(validate(c, 2));
  apply_override(c, "model.aux_loss_coeff", "0.001");
  EXPECT_EQ(error_of([&] { validate(c, 2); }),
            "command line (--model.aux_loss_coeff): model.aux_loss_coeff: the sequence-wise auxiliary loss needs each "
            "sequence's tokens on one rank, but parallel.tp (2) splits them");
  apply_override(c, "model.aux_loss_coeff", "0");
  apply_override(c, "parallel.tp", "1");
  c.data.seq_length = 64;
  apply_override(c, "parallel.cp", "2");
  apply_override(c, "model.aux_loss_coeff", "0.001");
  EXPECT_EQ(error_of([&] { validate(c, 2); }),
            "command line (--model.aux_loss_coeff): model.aux_loss_coeff: the sequence-wise auxiliary loss needs each "
            "sequence's tokens on one rank, but parallel.cp (2) splits them");
  apply_override(c, "parallel.cp", "1");
  EXPECT_NO_THROW(validate(c, 1));

  // Expert parallelism: within a replica's dp_shard x cp x tp ranks, dividing the experts.
  c.optim.batch_size = 24;  // divides over 2 and 3 ranks
  apply_override(c, "parallel.ep", "2");
  EXPECT_NO_THROW(validate(c, 2));
  EXPECT_EQ(error_of([&] { validate(c, 3); }),
            "command line (--parallel.ep): parallel.ep (2) must divide a replica's 3 ranks (parallel.dp_shard x "
            "parallel.cp x parallel.tp)");
  apply_override(c, "parallel.ep", "3");
  EXPECT_EQ(error_of([&] { validate(c, 3); }),
            "command line (--parallel.ep): parallel.ep (3) must divide model.num_experts (8)");
  // Elastic DiLoCo replicas meet by the shard layout's rows: a rank's experts must be its rows.
  apply_override(c, "parallel.ep", "2");
  apply_override(c, "diloco.inner_steps", "2");
  EXPECT_NO_THROW(validate(c, 6));
  apply_override(c, "diloco.peers", "localhost:29400");
  EXPECT_EQ(error_of([&] { validate(c, 6); }),
            "command line (--parallel.ep): parallel.ep (2) with elastic replicas (diloco.peers): model.num_experts (8) "
            "must divide over the shard group's 6 ranks, so that a rank's experts are its rows of the shard layout");
  EXPECT_NO_THROW(validate(c, 4));
  apply_override(c, "model.aux_loss_coeff", "0");  // (it needs whole sequences, which TP splits)
  apply_override(c, "parallel.tp", "2");  // the experts divided over TP's ranks too: not the shard layout's rows
  EXPECT_EQ(error_of([&] { validate(c, 4); }),
            "command line (--parallel.ep): parallel.ep (2) with elastic replicas (diloco.peers) and parallel.tp (2): "
            "the experts are divided over the TP ranks too, not as the shard layout's rows that mixed generations "
            "meet by; use parallel.tp = 1 or fixed replicas");
  c.diloco = Config().diloco;
  c.origins.erase("diloco.inner_steps");
  c.origins.erase("diloco.peers");
  c.optim.batch_size = 8;
  EXPECT_NO_THROW(validate(c, 2));  // EP over the TP group's ranks (one shard rank)
  apply_override(c, "parallel.tp", "1");
  c.optim.batch_size = 24;
  apply_override(c, "parallel.ep", "1");

  // A router's setting without experts is a mistake, not a no-op.
  Config dense = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n" + std::string(kMinimal), "x.toml");
  dense.optim.batch_size = 8;
  apply_override(dense, "model.top_k", "2");
  EXPECT_EQ(error_of([&] { validate(dense, 1); }),
            "command line (--model.top_k): model.top_k is a mixture of experts' setting, but model.num_experts is 0 "
            "(every block dense)");
  apply_override(dense, "model.top_k", "1");
  dense.origins.erase("model.top_k");
  apply_override(dense, "parallel.ep", "2");
  EXPECT_EQ(error_of([&] { validate(dense, 2); }),
            "command line (--parallel.ep): parallel.ep (2) splits a mixture's experts, but model.num_experts is 0");
}

// Expert-parallel groups: ep ranks of a replica's dp_shard_cp x tp, strided by dp_shard_cp x tp / ep,
// so that without TP the experts FSDP's rows give shard rank s belong to EP rank s / (dp_shard_cp / ep);
// each EP rank's experts sharded over the stride's consecutive ranks.
TEST(MeshShape, ExpertGroupsAreStridedWithinAShardGroup) {
  MeshShape m;
  m.dp_shard_cp = 8, m.ep = 2;
  EXPECT_EQ(m.ep_group_ranks(5), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(m.ep_rank_of(5), 1);
  EXPECT_EQ(m.ep_rank_of(3), 0);
  m.dp_shard_cp = 4, m.replicate = 2;  // HSDP 4 x 2: the second replica's ranks are 4..7
  EXPECT_EQ(m.ep_group_ranks(6), (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(m.ep_group_ranks(7), (std::vector<int64_t>{5, 7}));
  m.ep = 4;
  EXPECT_EQ(m.ep_group_ranks(2), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(m.ep_rank_of(6), 2);
  EXPECT_EQ(m.expert_shard_group_ranks(6), (std::vector<int64_t>{6}));
  m.ep = 2;
  EXPECT_EQ(m.expert_shard_group_ranks(6), (std::vector<int64_t>{6, 7}));
  // With TP (rank = shard rank x tp + TP rank within a replica): TP's ranks are among the EP and
  // expert-shard groups' members.
  m = MeshShape{};
  m.dp_shard_cp = 2, m.tp = 2, m.ep = 2;  // 4 ranks: EP over {0, 2} and {1, 3}, experts sharded over TP pairs
  EXPECT_EQ(m.ep_group_ranks(3), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(m.expert_shard_group_ranks(3), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(m.ep_rank_of(1), 0);
  m.ep = 4;  // every rank its own experts
  EXPECT_EQ(m.ep_group_ranks(1), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(m.expert_shard_group_ranks(1), (std::vector<int64_t>{1}));
  m.dp_shard_cp = 1, m.ep = 2, m.replicate = 2;  // EP from TP's ranks alone; the second replica's are 2, 3
  EXPECT_EQ(m.ep_group_ranks(3), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(m.ep_rank_of(3), 1);
}
