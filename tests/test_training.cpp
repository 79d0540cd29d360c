// Training-level check of the optimizer split on the debug model.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdio>

#include "config/config.h"
#include "data/token_shard.h"
#include "model/llama.h"
#include "config/model_config.h"
#include "optim/optimizer.h"

using namespace zb;

namespace {

// Trains the debug model (dim 256, 2 blocks, vocab 1024) on real text: the quick start's corpus
// (data/python-docs, which scripts/setup.sh makes: Python's documentation in the project's
// 1024-token BPE), its first training shard (about 1M tokens). Every run sees the same batches of
// 8 windows of 65 tokens. Returns the mean loss of the last 5 steps.
at::Tensor text_batches(int steps) {
  const TokenShard shard(std::string(ZB_SOURCE_DIR) + "/data/python-docs/train/shard_000000.bin");
  EXPECT_GT(shard.num_tokens(), 500000);
  EXPECT_LT(shard.max_token(), 1024);
  at::manual_seed(1);
  at::Tensor starts = at::randint(0, shard.num_tokens() - 65, {steps, 8}, at::kLong);
  at::Tensor data = at::empty({steps, 8, 65}, at::kLong);
  auto st = starts.accessor<int64_t, 2>();
  for (int s = 0; s < steps; ++s)
    for (int b = 0; b < 8; ++b) shard.read(st[s][b], 65, data[s][b].data_ptr<int64_t>());
  return data;
}

double train_debug_model(const std::string& optimizer_type, double hidden_lr, int steps) {
  Config c = load_config_string("name_model = \"debugmodel\"\ntype_model = \"llama2\"\n[train]\n[data]\nfake = true\n", "test");
  c.optim.optim.type = optimizer_type;
  c.optim.optim.lr = hidden_lr;
  // fp32 Newton-Schulz: the comparison is about the algorithm, and bf16 matrix products on a CPU
  // without native bf16 instructions (AVX2 only) run about 75 times slower than fp32 ones.
  c.optim.optim.ns_dtype = "float32";
  ModelArgs a = resolve_model_args(c);
  a.max_seq_len = 64;
  at::manual_seed(0);
  Llama model(a, at::TensorOptions());
  model.init_weights();
  Optimizer opt(c, whole_parameters(model.parameters()), model.kernels());
  at::Tensor data = text_batches(steps);
  double tail = 0;
  for (int s = 0; s < steps; ++s) {
    at::Tensor rows = data[s];
    at::Tensor loss = cross_entropy(model.forward(rows.slice(1, 0, 64)), rows.slice(1, 1, 65));
    loss.backward();
    opt.step(1.0);
    for (at::Tensor p : model.parameter_tensors()) p.mutable_grad().reset();
    if (s >= steps - 5) tail += loss.item<double>() / 5;
  }
  return tail;
}

}  // namespace

TEST(Training, MuonPlusAdamWBeatsAdamWAlone) {
  // One thread: ctest runs the multi-process tests beside this one, and OpenMP threads that
  // outnumber the free cores wait on each other (4x slower than one thread here).
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const int steps = 100;
  const double muon = train_debug_model("muon", 0.02, steps);  // ZeroBand's Muon lr
  // AdamW alone, hidden matrices at the best of three learning rates (the embedding, head and
  // norm groups are the same AdamW groups in both runs).
  double adamw = 1e9;
  for (double lr : {1e-3, 3e-3, 1e-2}) {
    const double loss = train_debug_model("adamw", lr, steps);
    std::printf("AdamW alone, hidden lr %g: %.4f\n", lr, loss);
    adamw = std::min(adamw, loss);
  }
  std::printf("debug model, %d steps of the Python docs corpus: Muon+AdamW %.4f, best AdamW %.4f\n", steps,
              muon, adamw);
  EXPECT_LT(muon, adamw);
  at::set_num_threads(threads);
}
