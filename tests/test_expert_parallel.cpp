// Expert parallelism's dispatch and combine (model/moe.h's routed_experts_parallel) on real ranks
// over loopback Gloo, against routed_experts on one process: every rank routes its own tokens
// through the same gate, holds its part of the experts, and its outputs and gradients must be the
// single process's on the same tokens and the whole experts. And checkpoints across EP degrees.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <unistd.h>

#include <filesystem>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "dist/comm.h"
#include "dist/world.h"
#include "model/moe.h"
#include "multiprocess.h"
#include "parallel/model_parallel_group.h"
#include "train/checkpoint_state.h"
#include "train/trainer.h"

using namespace zb;

namespace {

double max_abs(const at::Tensor& t) { return t.numel() ? t.abs().max().item<double>() : 0.0; }

// Every rank's tokens, the gate, the biases and the whole experts, drawn alike on every rank;
// `skewed`: a bias that sends every token to expert 0 first (the others' ranks receive little or
// nothing).
struct Case {
  at::Tensor x, gate, bias, w1, w2, w3, grad_out;  // x and grad_out: [world, N, D]
};

Case make_case(int64_t world, int64_t N, int64_t D, int64_t E, int64_t F, bool skewed) {
  at::manual_seed(11);
  Case c;
  c.x = at::randn({world, N, D}, at::kDouble);
  c.gate = at::randn({E, D}, at::kDouble) * 0.5;
  c.bias = at::zeros({E}, at::kFloat);
  if (skewed) c.bias[0] = 100.0;
  c.w1 = at::randn({E, F, D}, at::kDouble) * 0.3;
  c.w2 = at::randn({E, D, F}, at::kDouble) * 0.3;
  c.w3 = at::randn({E, F, D}, at::kDouble) * 0.3;
  c.grad_out = at::randn({world, N, D}, at::kDouble);
  return c;
}

void expect_parallel_equals_one_process(int world, bool skewed) {
  multiprocess::run_ranks(world, [world, skewed](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    CommModelParallelGroup ep(comm);
    const int64_t N = 24, D = 16, E = 8, F = 12, local = E / world;
    const Case c = make_case(world, N, D, E, F, skewed);
    RouterConfig router;
    router.num_experts = E, router.top_k = 2, router.route_norm = true;
    // In fp32 (the grouped GEMM's), from the same float64 draws.
    auto leaf = [](const at::Tensor& t) { return t.to(at::kFloat).detach().requires_grad_(true); };

    // One process: every rank's tokens, the whole experts.
    const at::Tensor x_all = leaf(c.x.reshape({world * N, D})), gate_all = leaf(c.gate);
    const at::Tensor w1 = leaf(c.w1), w2 = leaf(c.w2), w3 = leaf(c.w3);
    const Routing all = route(x_all, gate_all, c.bias, router);
    const at::Tensor want = routed_experts(x_all, all, w1, w2, w3);
    (want * c.grad_out.reshape({world * N, D}).to(at::kFloat)).sum().backward();

    // This rank: its tokens, its experts.
    const at::Tensor x = leaf(c.x[rank]), gate = leaf(c.gate);
    const at::Tensor l1 = leaf(c.w1.narrow(0, rank * local, local)), l2 = leaf(c.w2.narrow(0, rank * local, local)),
                     l3 = leaf(c.w3.narrow(0, rank * local, local));
    const Routing mine = route(x, gate, c.bias, router);
    const at::Tensor got = routed_experts_parallel(x, mine, l1, l2, l3, ep);
    (got * c.grad_out[rank].to(at::kFloat)).sum().backward();

    EXPECT_LE(max_abs(got - want.narrow(0, rank * N, N)), 1e-5);
    EXPECT_LE(max_abs(x.grad() - x_all.grad().narrow(0, rank * N, N)), 1e-5);
    // The experts' gradients: from every rank's tokens routed to them.
    EXPECT_LE(max_abs(l1.grad() - w1.grad().narrow(0, rank * local, local)), 1e-5);
    EXPECT_LE(max_abs(l2.grad() - w2.grad().narrow(0, rank * local, local)), 1e-5);
    EXPECT_LE(max_abs(l3.grad() - w3.grad().narrow(0, rank * local, local)), 1e-5);
    // The gate's: this rank's tokens' part of the whole (the engine sums the ranks').
    at::Tensor gate_sum = gate.grad().clone();
    comm.all_reduce_sum(gate_sum).wait();
    EXPECT_LE(max_abs(gate_sum - gate_all.grad()), 1e-5);
    if (skewed) {  // every token's first choice is expert 0: rank 0 received every rank's tokens
      EXPECT_EQ(mine.experts.select(1, 0).eq(0).all().item<bool>(), true);
      EXPECT_TRUE(l1.grad().defined());
    }
    // Reruns give the same bits.
    EXPECT_TRUE(at::equal(routed_experts_parallel(x, mine, l1, l2, l3, ep).detach(), got.detach()));
  });
}

}  // namespace

TEST(ExpertParallel, TwoRanksEqualOneProcess) { expect_parallel_equals_one_process(2, false); }
TEST(ExpertParallel, FourRanksEqualOneProcess) { expect_parallel_equals_one_process(4, false); }
TEST(ExpertParallel, EveryTokenToTheFirstRanksExperts) { expect_parallel_equals_one_process(4, true); }

// A checkpoint saved under one expert-parallel degree and loaded under another holds the same
// state bit for bit: trained 2 steps at EP 2 x FSDP 4 and saved, loaded at EP 4 (and at EP 1, and at
// EP 4 over TP 2 x FSDP 2) and saved again, then loaded back at EP 2, the third step's loss and every
// parameter after it are those of the run that never stopped. The round trip carries everything a step reads: the
// parameters, Muon's and AdamW's state, the balancing biases, the counters and the data position.
TEST(ExpertParallel, CheckpointsCrossEpDegreesBitForBit) {
  const std::string root = ::testing::TempDir() + "zb_ep_resume_" + std::to_string(::getpid());
  multiprocess::run_ranks(4, [&root](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    auto config = [&](int64_t ep, const std::string& path, int64_t tp = 1) {
      Config c = load_config_string(
          "name_model = \"debugmodel\"\ntype_model = \"llama2\"\n"
          "[model]\nn_layers = 2\ndim = 64\nnum_experts = 4\ntop_k = 2\nmoe_inter_dim = 32\nn_dense_layers = 1\n"
          "num_shared_experts = 1\nload_balance_coeff = 0.01\n"
          "[train]\nmicro_bs = 1\n[optim]\nbatch_size = 8\ntotal_steps = 4\nwarmup_steps = 1\n"
          "[optim.optim]\nns_dtype = \"float32\"\n[data]\nfake = true\nseq_length = 16\neval_interval = 0\n"
          "[runtime]\ndevice = \"cpu\"\n[ckpt]\npath = \"" + path + "\"\n[parallel]\nep = " + std::to_string(ep) +
              "\ntp = " + std::to_string(tp) + "\n",
          "test");
      validate(c, 4);
      return c;
    };
    auto params = [](Trainer& t) {
      std::vector<at::Tensor> out;
      for (auto& [name, value] : t.parallel().gather_full_parameters()) out.push_back(value);
      return out;
    };
    auto save = [&](Trainer& t, const Config& c) {
      TrainerCheckpointState state(t);
      CheckpointWriter writer(c, comm);
      const std::string dir = writer.save(state);
      writer.finish();
      return dir;
    };
    // The run that never stops, at EP 2.
    const Config c2 = config(2, root + "/ep2");
    Trainer straight(c2, ParallelMesh(c2, comm, EngineKind::Sharded), c10::Device(c10::kCPU));
    straight.train_step();
    straight.train_step();
    const std::string saved = save(straight, c2);
    const double loss3 = straight.train_step().loss;
    const std::vector<at::Tensor> after3 = params(straight);

    // EP 4, EP 1, and EP 4 over TP 2 x FSDP 2 (a rank's experts sharded over its TP group's).
    for (const auto& [other, tp] : std::vector<std::pair<int64_t, int64_t>>{{4, 1}, {1, 1}, {4, 2}}) {
      const Config co = config(other, root + "/ep" + std::to_string(other) + "_tp" + std::to_string(tp), tp);
      Trainer there(co, ParallelMesh(co, comm, EngineKind::Sharded), c10::Device(c10::kCPU));
      TrainerCheckpointState into_there(there);
      load_checkpoint(saved, into_there, comm);
      const std::string again = save(there, co);

      Trainer back(c2, ParallelMesh(c2, comm, EngineKind::Sharded), c10::Device(c10::kCPU));
      TrainerCheckpointState into_back(back);
      load_checkpoint(again, into_back, comm);
      EXPECT_EQ(back.train_step().loss, loss3) << "through EP " << other << ", TP " << tp;
      const std::vector<at::Tensor> got = params(back);
      ASSERT_EQ(got.size(), after3.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], after3[i])) << "parameter " << i;
    }
  });
  std::filesystem::remove_all(root);
}
