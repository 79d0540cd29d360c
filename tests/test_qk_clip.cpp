// The attention logits' watch and QK-clip (parallel/qk_clip.h): the watched maximum against full
// attention in float64, the clip's effect on one model, and every layout against one process.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "dist/comm.h"
#include "dist/world.h"
#include "model/attention.h"
#include "model/llama.h"
#include "model_parallel/context_parallel.h"
#include "multiprocess.h"
#include "parallel/qk_clip.h"
#include "train/trainer.h"

using namespace zb;

namespace {

// Each head's largest q·k/√Dh over the (query, key) pairs `sees` allows, from every score in
// float64: q [B, Tq, H, Dh], k [B, Tk, Hkv, Dh]; sees(b, i, j) for query i and key j.
template <typename Sees>
std::vector<double> full_attention_max(const at::Tensor& q, const at::Tensor& k, Sees sees) {
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), Dh = q.size(3), Tk = k.size(1), G = H / k.size(2);
  const at::Tensor qd = q.to(at::kDouble), kd = k.to(at::kDouble);
  std::vector<double> out(static_cast<size_t>(H), -std::numeric_limits<double>::infinity());
  for (int64_t h = 0; h < H; ++h) {
    const at::Tensor s = at::einsum("bid,bjd->bij", {qd.select(2, h), kd.select(2, h / G)}) / std::sqrt(double(Dh));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t j = 0; j < Tk; ++j)
          if (sees(b, i, j)) out[static_cast<size_t>(h)] = std::max(out[static_cast<size_t>(h)], s[b][i][j].item<double>());
  }
  return out;
}

void expect_close(const at::Tensor& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  for (size_t h = 0; h < want.size(); ++h)
    EXPECT_NEAR(got[static_cast<int64_t>(h)].item<double>(), want[h], 1e-5 * std::abs(want[h])) << what << ", head " << h;
}

}  // namespace

// The watched maximum (GQA: 4 query heads on 2 key heads) equals full attention's in float64 on
// each way attention reads a micro-batch: causal rows; the CPU's document mask; the variable-length
// kernels' documents (each token's document number, no mask); and a CP rank's queries against the
// whole rows' keys in the group's order.
TEST(AttentionLogits, MaxEqualsFullAttentionInFloat64) {
  at::manual_seed(3);
  const int64_t B = 2, T = 12, H = 4, Hkv = 2, Dh = 8;
  const at::Tensor q = at::randn({B, T, H, Dh}), k = at::randn({B, T, Hkv, Dh});
  expect_close(max_attention_logits(q, k, Documents{}), full_attention_max(q, k, [](int64_t, int64_t i, int64_t j) {
                 return i >= j;
               }),
               "causal");
  // Documents of 5, 7 | 7, 5 tokens over the two rows.
  const at::Tensor cu = at::tensor({0, 5, 12, 19, 24}, at::kInt);
  const at::Tensor doc = document_ids(cu, B, T);
  auto same_doc = [&](int64_t b, int64_t i, int64_t j) { return doc[b][i].item<int>() == doc[b][j].item<int>(); };
  const Documents masked = make_documents(cu, 7, T, at::kCPU, at::kFloat, /*flash=*/false);
  expect_close(max_attention_logits(q, k, masked),
               full_attention_max(q, k, [&](int64_t b, int64_t i, int64_t j) { return i >= j && same_doc(b, i, j); }),
               "document mask");
  Documents numbered;
  numbered.row_documents = doc;
  expect_close(max_attention_logits(q, k, numbered),
               full_attention_max(q, k, [&](int64_t b, int64_t i, int64_t j) { return i >= j && same_doc(b, i, j); }),
               "document numbers");
  // CP rank 1 of 2: its positions' queries, the keys gathered in the group's order.
  Documents cp = numbered;
  cp.positions = cp_positions(1, 2, T);
  const at::Tensor gathered = cp_gathered_positions(2, T);
  const at::Tensor qp = q.index_select(1, cp.positions), kg = k.index_select(1, gathered);
  expect_close(max_attention_logits(qp, kg, cp, gathered),
               full_attention_max(qp, kg, [&](int64_t b, int64_t i, int64_t j) {
                 const int64_t pi = cp.positions[i].item<int64_t>(), pj = gathered[j].item<int64_t>();
                 return pi >= pj && same_doc(b, pi, pj);
               }),
               "CP rank 1 of 2");
}

// Rows long enough that the queries go in several chunks (each seeing the keys up to its last
// query), with documents by number: against float64 scores of the whole rows, vectorised.
TEST(AttentionLogits, LongRowsInChunks) {
  at::manual_seed(4);
  const int64_t B = 2, T = 1536, H = 4, Hkv = 2, Dh = 8;
  const at::Tensor q = at::randn({B, T, H, Dh}), k = at::randn({B, T, Hkv, Dh});
  const at::Tensor cu = at::tensor({0, 700, 1536, 2000, 3072}, at::kInt);
  Documents numbered;
  numbered.row_documents = document_ids(cu, B, T);
  const at::Tensor pos = at::arange(T, at::kLong), doc = numbered.row_documents;
  const at::Tensor sees = (pos.unsqueeze(1) >= pos.unsqueeze(0)).unsqueeze(0).logical_and(doc.unsqueeze(2) == doc.unsqueeze(1));
  const at::Tensor scores = at::matmul(q.to(at::kDouble).transpose(1, 2),
                                       k.to(at::kDouble).repeat_interleave(H / Hkv, 2).permute({0, 2, 3, 1})) /
                            std::sqrt(double(Dh));  // [B, H, T, T]
  const at::Tensor want = scores.masked_fill(sees.unsqueeze(1).logical_not(), -INFINITY).amax({0, 2, 3});
  const at::Tensor got = max_attention_logits(q, k, numbered);
  EXPECT_LE((got.to(at::kDouble) - want).abs().max().item<double>(), 1e-5 * want.abs().max().item<double>());
}

// One model (GQA: 4 query heads on 2 key heads), one batch: after QK-clip at a threshold below
// some heads' largest logits (α = 0.3), the same batch's forward finds the first block's every
// head at or below the threshold (to rounding); the clipped heads' query rows are their old values times γ^α and their
// key heads' rows times the smallest γ^(1-α) of theirs; every other row of wq and wk, and every
// other tensor, is bit for bit what it was.
TEST(QkClip, ClippedHeadsComeBackToTheThresholdAndNothingElseMoves) {
  multiprocess::run_ranks(1, [](int) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    ModelArgs a;
    a.dim = 64, a.n_layers = 2, a.n_heads = 4, a.n_kv_heads = 2, a.vocab_size = 64, a.max_seq_len = 32;
    at::manual_seed(11);
    Llama model(a, at::TensorOptions());
    model.init_weights();
    for (at::Tensor t : model.parameter_tensors()) t.detach().mul_(3.0);  // logits well apart
    const at::Tensor tokens = at::randint(64, {2, 16}, at::kLong), targets = at::randint(64, {2, 16}, at::kLong);
    const double alpha = 0.3;
    auto watched = [&] {  // one training forward; each block's heads' largest logits
      model.loss(tokens, targets).backward();
      std::vector<at::Tensor> out;
      for (const at::Tensor& t : model.attention_logits()) out.push_back(t.to(at::kDouble).clone());
      return out;
    };
    std::vector<at::Tensor> S;
    double lowest = 1e300, highest = -1e300;
    {
      QkClip watch(model, {&comm}, 0, alpha);
      S = watched();
      watch.step(false, whole_parameters(model.parameters()));
    }
    for (const at::Tensor& s : S) lowest = std::min(lowest, s.min().item<double>()), highest = std::max(highest, s.max().item<double>());
    const double tau = 0.5 * (lowest + highest);
    std::vector<at::Tensor> before;
    for (const auto& p : model.parameters()) before.push_back(p.slot->detach().clone());
    QkClip clip(model, {&comm}, tau, alpha);
    watched();
    const AttentionLogitStats stats = clip.step(true, whole_parameters(model.parameters()));
    int64_t above = 0;
    for (const at::Tensor& s : S) above += (s > tau).sum().item<int64_t>();
    EXPECT_EQ(stats.heads_clipped, above);
    ASSERT_GT(above, 0);
    ASSERT_LT(above, a.n_layers * a.n_heads);

    const auto& params = model.parameters();
    const int64_t Dh = a.head_dim();
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string& n = params[i].name;
      const at::Tensor now = params[i].slot->detach();
      const bool query = n.find("attention.wq") != std::string::npos, key = n.find("attention.wk") != std::string::npos;
      if (!query && !key) {
        EXPECT_TRUE(at::equal(now, before[i])) << n;
        continue;
      }
      const at::Tensor& s = S[static_cast<size_t>(params[i].layer)];
      for (int64_t head = 0; head < now.size(0) / Dh; ++head) {
        double factor = 1;
        if (query && s[head].item<double>() > tau) factor = std::pow(tau / s[head].item<double>(), alpha);
        if (key) {
          const double largest = s.narrow(0, head * 2, 2).max().item<double>();  // its 2 query heads
          if (largest > tau) factor = std::pow(tau / largest, 1 - alpha);
        }
        const at::Tensor rows = now.narrow(0, head * Dh, Dh), old = before[i].narrow(0, head * Dh, Dh);
        if (factor == 1) EXPECT_TRUE(at::equal(rows, old)) << n << " head " << head;
        else EXPECT_LE((rows - old * factor).abs().max().item<double>(), 1e-6 * old.abs().max().item<double>()) << n;
      }
    }
    // The same batch again: the first block's every head at or below τ (a later block's logits
    // move with the blocks before it, whose outputs the clip changed).
    const std::vector<at::Tensor> after = watched();
    ASSERT_GT((S[0] > tau).sum().item<int64_t>(), 0);
    EXPECT_LE(after[0].max().item<double>(), tau * (1 + 1e-5));
  });
}

// QK-clip firing from the first step (a threshold below every block's first largest logit), GQA:
// FSDP 2, TP 2 (each rank its heads), CP 2 gathering the keys and around the ring equal one
// process over 4 steps: losses and parameters (1e-5), each block's logged largest logit (1e-5) and
// the heads clipped.
TEST(QkClip, LayoutsEqualOneProcess) {
  multiprocess::run_ranks(2, [](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    auto config = [](double tau, const std::string& parallel) {
      Config c = load_config_string(
          "name_model = \"debugmodel\"\ntype_model = \"llama2\"\n"
          "[model]\nn_layers = 2\ndim = 64\nn_heads = 4\nn_kv_heads = 2\n"
          "[train]\nmicro_bs = 1\n[optim]\nbatch_size = 4\ntotal_steps = 4\nwarmup_steps = 1\n"
          "[optim.optim]\nns_dtype = \"float32\"\nqk_clip_alpha = 0.3\nqk_clip_threshold = " + std::to_string(tau) +
          "\n[logging]\nmax_attention_logit = true\n[data]\nfake = true\nseq_length = 32\neval_interval = 0\n"
          "[runtime]\ndevice = \"cpu\"\n[parallel]\n" + parallel,
          "test");
      return c;
    };
    std::unique_ptr<Communicator> solo = comm.subgroup("solo" + std::to_string(rank), {rank});
    auto run = [&](const Config& c, Communicator& over) {
      validate(c, over.size());
      Trainer t(c, ParallelMesh(c, over, EngineKind::Sharded), c10::Device(c10::kCPU));
      std::vector<StepStats> steps;
      for (int s = 0; s < 4; ++s) steps.push_back(t.train_step());
      std::map<std::string, at::Tensor> params;
      for (auto& [name, value] : t.parallel().gather_full_parameters()) params[name] = value;
      return std::make_pair(steps, params);
    };
    // The threshold: below every block's largest logit at step 1.
    Config watch = config(0, "");
    watch.optim.total_steps = 1;
    validate(watch, 1);
    Trainer first(watch, ParallelMesh(watch, *solo, EngineKind::Sharded), c10::Device(c10::kCPU));
    const StepStats s1 = first.train_step();
    const double tau = 0.9 * *std::min_element(s1.max_attention_logit.begin(), s1.max_attention_logit.end());

    const auto [want_steps, want_params] = run(config(tau, ""), *solo);
    EXPECT_GT(want_steps[0].qk_clipped_heads, 0);
    for (const auto& [name, parallel] : std::vector<std::pair<std::string, std::string>>{
             {"FSDP 2", ""}, {"TP 2", "tp = 2\n"}, {"CP 2", "cp = 2\n"}, {"CP 2, ring", "cp = 2\ncp_rotate = \"ring\"\n"}}) {
      const auto [steps, params] = run(config(tau, parallel), comm);
      for (size_t s = 0; s < steps.size(); ++s) {
        const StepStats &got = steps[s], &want = want_steps[s];
        EXPECT_NEAR(got.loss, want.loss, 1e-5 * std::abs(want.loss)) << name << " step " << s + 1;
        EXPECT_EQ(got.qk_clipped_heads, want.qk_clipped_heads) << name << " step " << s + 1;
        ASSERT_EQ(got.max_attention_logit.size(), want.max_attention_logit.size());
        for (size_t l = 0; l < want.max_attention_logit.size(); ++l)
          EXPECT_NEAR(got.max_attention_logit[l], want.max_attention_logit[l], 1e-5 * std::abs(want.max_attention_logit[l]))
              << name << " step " << s + 1 << " block " << l;
      }
      for (const auto& [n, w] : want_params)
        EXPECT_LE((params.at(n) - w).norm().item<double>(), 1e-5 * w.norm().item<double>()) << name << " " << n;
    }
  });
}
