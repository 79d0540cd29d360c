// Expert parallelism's dispatch and combine (model/moe.h's routed_experts_parallel) on real ranks
// over loopback Gloo, against routed_experts on one process: every rank routes its own tokens
// through the same gate, holds its part of the experts, and its outputs and gradients must be the
// single process's on the same tokens and the whole experts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "dist/comm.h"
#include "dist/world.h"
#include "model/moe.h"
#include "multiprocess.h"
#include "parallel/model_parallel_group.h"

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
