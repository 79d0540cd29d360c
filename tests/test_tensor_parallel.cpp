// Tensor parallelism inside the model (model_parallel/tensor_parallel.h), on real processes over Gloo:
// the vocabulary-parallel loss against PyTorch's cross-entropy of the whole logits, the whole
// model split over 2 and 4 ranks against the same model on one process, in float64, and against
// PyTorch's own tensor parallelism (DTensor) on the same weights and batch.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "model/attention.h"
#include "model/chunked_loss.h"
#include "model/llama.h"
#include "multiprocess.h"
#include "parallel/model_parallel_group.h"
#include "reference_data.h"

using namespace zb;

namespace {

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

Communicator world_group() { return Communicator(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60)); }

}  // namespace

TEST(TensorParallelShapes, RefusesWhatDoesNotDivide) {
  ModelArgs a;
  a.dim = 64;
  a.n_heads = 8;
  a.n_kv_heads = 2;
  a.vocab_size = 96;
  a.multiple_of = 4;  // FFN hidden 172: divides into 2 and 4 ranks, not 8
  for (const int64_t tp : {1, 2, 4}) EXPECT_NO_THROW(check_tensor_parallel(a, tp)) << tp;
  auto message = [&](const ModelArgs& args, int64_t tp) {
    try {
      check_tensor_parallel(args, tp);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(a, 3), "tensor parallelism over 3 ranks: the 8 attention heads do not divide into them");
  EXPECT_EQ(message(a, 8), "tensor parallelism over 8 ranks: the FFN's hidden size 172 does not divide into them");
  ModelArgs kv = a;
  kv.n_kv_heads = 4;
  kv.n_heads = 12;
  EXPECT_EQ(message(kv, 6), "tensor parallelism over 6 ranks: the 4 key/value heads must divide into them or each be "
                            "shared by a whole number of them");
  ModelArgs vocab = a;
  vocab.vocab_size = 90;
  EXPECT_EQ(message(vocab, 4), "tensor parallelism over 4 ranks: the vocabulary of 90 words does not divide into them");
}

TEST(TensorParallel, VocabularyParallelLossEqualsTorchCrossEntropy) {
  // 11 tokens, 24 words over 2 and 3 ranks, in chunks of 4 tokens (uneven last) and all at once;
  // targets on every rank's words. Reference: at::cross_entropy_loss of the whole logits and its
  // autograd. float64 to 1e-12; fp32 to 1e-5. The input's gradient is each rank's words' part:
  // summed over the ranks it is the whole.
  for (const int world : {2, 3}) {
    multiprocess::run_ranks(world, [world](int rank) {
      Communicator comm = world_group();
      CommModelParallelGroup group(comm);
      const int64_t N = 11, D = 8, V = 24, Vr = V / world;
      for (const auto dtype : {at::kDouble, at::kFloat}) {
        const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
        at::manual_seed(3);
        const at::Tensor x0 = at::randn({N, D}, at::kDouble).to(dtype);
        const at::Tensor w0 = at::randn({V, D}, at::kDouble).to(dtype);
        const at::Tensor targets = at::randint(0, V, {N}, at::kLong);
        at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
        at::Tensor want = at::cross_entropy_loss(at::linear(x, w).to(dtype), targets);
        want.backward();
        for (const int64_t chunk : {int64_t{4}, N}) {
          SCOPED_TRACE(std::to_string(world) + " ranks, chunk " + std::to_string(chunk) + ", " + c10::toString(dtype));
          at::Tensor xr = x0.clone().requires_grad_(true);
          at::Tensor wr = w0.narrow(0, rank * Vr, Vr).clone().requires_grad_(true);
          const CommStats before = comm.stats();
          at::Tensor got = chunked_cross_entropy(xr, wr, targets, chunk, &group, rank * Vr);
          const int64_t chunks = (N + chunk - 1) / chunk;
          EXPECT_EQ(comm.stats().bytes[static_cast<size_t>(CommKind::AllGather)] -
                        before.bytes[static_cast<size_t>(CommKind::AllGather)],
                    chunks == 1 ? ring_counted_bytes(CommKind::AllGather, world, N * 2 * at::elementSize(dtype))
                                : 2 * ring_counted_bytes(CommKind::AllGather, world, 4 * 2 * at::elementSize(dtype)) +
                                      ring_counted_bytes(CommKind::AllGather, world, 3 * 2 * at::elementSize(dtype)))
              << "one all-gather of (log-sum-exp, target logit) per chunk";
          EXPECT_NEAR(got.item<double>(), want.item<double>(), tol * want.item<double>());
          got.backward();
          at::Tensor dx = xr.grad().clone();
          comm.all_reduce_sum(dx).wait();
          EXPECT_LE(max_abs(dx - x.grad()), tol * max_abs(x.grad()));
          const at::Tensor dw_want = w.grad().narrow(0, rank * Vr, Vr);
          EXPECT_LE(max_abs(wr.grad() - dw_want), tol * max_abs(dw_want));
        }
      }
    });
  }
}

namespace {

// A small model whose every shape divides into 4 ranks: 4 query heads, FFN hidden 96, 64 words.
ModelArgs small_model(int64_t kv_heads) {
  ModelArgs a;
  a.dim = 32;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = kv_heads;
  a.vocab_size = 64;
  a.multiple_of = 16;
  a.max_seq_len = 16;
  return a;
}

}  // namespace

TEST(TensorParallel, ModelEqualsTheSingleProcess) {
  // The model split over 2 and 4 ranks (sequence parallelism, vocabulary-parallel embedding and
  // loss), with 4 key/value heads (split) and 2 (on 4 ranks: each shared by two), with and without
  // the document mask, against the same model on one process from the same seed, in float64: the
  // initial values are the whole model's slices, the loss is equal on every rank (1e-12), and each
  // rank's gradient is its slice of the whole gradient (norm weights and shared key/value heads:
  // the whole, summed over the ranks; 1e-10 of the largest).
  for (const int world : {2, 4}) {
    multiprocess::run_ranks(world, [world](int rank) {
      Communicator comm = world_group();
      CommModelParallelGroup group(comm);
      const auto options = at::TensorOptions().dtype(at::kDouble);
      const int64_t B = 2, T = 8;
      for (const int64_t kv_heads : {4, 2})
        for (const bool documents_on : {false, true}) {
          SCOPED_TRACE(std::to_string(world) + " ranks, " + std::to_string(kv_heads) + " kv heads" +
                       (documents_on ? ", documents" : ""));
          const ModelArgs args = small_model(kv_heads);
          at::manual_seed(11);
          const at::Tensor tokens = at::randint(0, args.vocab_size, {B, T + 1}, at::kLong);
          const at::Tensor input = tokens.narrow(1, 0, T).contiguous(), targets = tokens.narrow(1, 1, T).contiguous();
          Documents documents;
          if (documents_on)
            documents = make_documents(at::tensor({0, 3, 8, 13, 16}, at::kInt), 5, T, c10::kCPU, at::kDouble, false);

          at::manual_seed(7);
          Llama whole(args, options);
          whole.init_weights();
          at::Tensor want = whole.loss(input, targets, documents);
          want.backward();

          at::manual_seed(7);
          Llama split(args, options, true, &group);
          split.init_weights();
          ASSERT_EQ(split.tp_size(), world);
          at::Tensor got = split.loss(input, targets, documents);
          EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-12);
          got.backward();

          const auto& w = whole.parameters();
          const auto& s = split.parameters();
          ASSERT_EQ(w.size(), s.size());
          for (size_t i = 0; i < w.size(); ++i) {
            SCOPED_TRACE(s[i].name);
            ASSERT_EQ(s[i].global_shape, w[i].slot->sizes().vec());
            const bool expect_split = s[i].name.find("norm") == std::string::npos &&
                                      !(kv_heads < world && (s[i].name.find(".wk.") != std::string::npos ||
                                                             s[i].name.find(".wv.") != std::string::npos));
            EXPECT_EQ(s[i].tp.split(), expect_split);
            auto mine = [&](const at::Tensor& t) {
              return s[i].tp.split() ? t.narrow(s[i].tp.dim, s[i].tp.start, s[i].slot->size(s[i].tp.dim)) : t;
            };
            if (s[i].tp.split())
              EXPECT_EQ(s[i].tp.start, rank * s[i].slot->size(s[i].tp.dim));
            EXPECT_TRUE(at::equal(*s[i].slot, mine(*w[i].slot))) << "initial values";
            const at::Tensor want_grad = mine(w[i].slot->grad());
            EXPECT_LE(max_abs(s[i].slot->grad() - want_grad), 1e-10 * max_abs(w[i].slot->grad()));
          }
        }
    });
  }
}

TEST(TensorParallel, EqualsPyTorchsTensorParallelism) {
  // tests/reference/tp_reference.py splits a Llama written there over 2 Gloo processes with
  // torch.distributed.tensor.parallel (ColwiseParallel, RowwiseParallel, SequenceParallel,
  // loss_parallel), with 4 and 2 key/value heads, and writes the whole weights, the batch, its loss,
  // its full logits and each rank's local gradient. Ours on 2 real ranks from the same weights:
  // the same loss (fp32, 1e-5 relative), each rank's gradient slice equal to the same rank's of
  // PyTorch (1e-5 of the largest), the same slice of every parameter split along the same
  // dimension; the logits of our model on one process equal the TP run's (1e-5).
  const reference::ReferenceData ref = reference::run_reference("tp_reference.py", "2");
  ASSERT_EQ(ref.manifest["tp"].get<int>(), 2);
  multiprocess::run_ranks(2, [&ref](int rank) {
    Communicator comm = world_group();
    CommModelParallelGroup group(comm);
    for (const std::string c : ref.manifest["cases"]) {
      SCOPED_TRACE(c + ", rank " + std::to_string(rank));
      auto arg = [&](const std::string& field) { return ref.manifest[c + "/args/" + field]; };
      ModelArgs args;
      args.dim = arg("dim");
      args.n_layers = arg("n_layers");
      args.n_heads = arg("n_heads");
      args.n_kv_heads = arg("n_kv_heads");
      args.vocab_size = arg("vocab_size");
      args.multiple_of = arg("multiple_of");
      args.max_seq_len = arg("max_seq_len");
      ASSERT_EQ(args.ffn_hidden(), arg("ffn_hidden").get<int64_t>());
      ASSERT_EQ(args.norm_eps, arg("norm_eps").get<double>());
      ASSERT_EQ(args.rope_theta, arg("rope_theta").get<double>());
      const at::Tensor tokens = ref[c + "/tokens"].to(at::kLong);
      const int64_t T = tokens.size(1) - 1;
      const at::Tensor input = tokens.narrow(1, 0, T).contiguous(), targets = tokens.narrow(1, 1, T).contiguous();

      Llama whole(args, at::TensorOptions().dtype(at::kFloat));
      Llama split(args, at::TensorOptions().dtype(at::kFloat), true, &group);
      at::NoGradGuard no_grad;
      for (Llama* m : {&whole, &split})
        for (const NamedParameter& p : m->parameters()) {
          const at::Tensor w = ref[c + "/weight/" + p.name];
          p.slot->copy_(p.tp.split() ? w.narrow(p.tp.dim, p.tp.start, p.slot->size(p.tp.dim)) : w);
        }
      const at::Tensor logits = whole.forward(input);
      EXPECT_LE(max_abs(logits - ref[c + "/logits"]), 1e-5 * max_abs(ref[c + "/logits"])) << "logits";
      {
        at::AutoGradMode grad(true);
        const at::Tensor loss = split.loss(input, targets);
        const double want = ref[c + "/loss"].item<double>();
        EXPECT_NEAR(loss.item<double>(), want, 1e-5 * std::abs(want));
        loss.backward();
      }
      for (const NamedParameter& p : split.parameters()) {
        SCOPED_TRACE(p.name);
        EXPECT_EQ(p.tp.dim, ref.manifest["split/" + p.name].get<int64_t>()) << "split along the same dimension";
        const at::Tensor want = ref[c + "/grad/" + std::to_string(rank) + "/" + p.name];
        ASSERT_EQ(p.slot->grad().sizes(), want.sizes());
        EXPECT_LE(max_abs(p.slot->grad() - want), 1e-5 * max_abs(want));
      }
    }
  });
}
