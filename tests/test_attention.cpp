// Document-causal attention: where the loader cuts rows into documents, and attention within them
// against a float64 softmax written out element by element over an explicit block-diagonal causal
// mask; gradients against finite differences.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <unistd.h>
#include <vector>

#include "data/documents.h"
#include "model/attention.h"
#include "model_parallel/context_parallel.h"
#include "util/fs.h"

using namespace zb;

namespace {

// Cumulative lengths for rows of tokens, as the loader makes them.
at::Tensor cu_of(const std::vector<std::vector<int64_t>>& rows, const DocumentDelimiter& d, int64_t& max_len) {
  std::vector<int32_t> cu{0};
  max_len = 0;
  for (const auto& r : rows) append_document_bounds(r.data(), static_cast<int64_t>(r.size()), d, cu, max_len);
  return at::tensor(cu, at::kInt);
}

// Element by element: out[b, i, h] = sum_j softmax_j(q_i . k_j / sqrt(Dh)) v_j over the keys j
// with allowed(b, i, j).
template <class Allowed>
at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Allowed allowed) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dh = q.size(3), group = H / k.size(2);
  auto qa = q.accessor<double, 4>(), ka = k.accessor<double, 4>(), va = v.accessor<double, 4>();
  at::Tensor out = at::zeros({B, T, H * Dh}, at::kDouble);
  auto oa = out.accessor<double, 3>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> w(T, 0.0);
        double top = -INFINITY, sum = 0;
        for (int64_t j = 0; j < T; ++j) {
          if (!allowed(b, i, j)) continue;
          double s = 0;
          for (int64_t d = 0; d < Dh; ++d) s += qa[b][i][h][d] * ka[b][j][h / group][d];
          w[j] = s / std::sqrt(static_cast<double>(Dh));
          top = std::max(top, w[j]);
        }
        for (int64_t j = 0; j < T; ++j) sum += allowed(b, i, j) ? std::exp(w[j] - top) : 0.0;
        for (int64_t j = 0; j < T; ++j) {
          if (!allowed(b, i, j)) continue;
          const double p = std::exp(w[j] - top) / sum;
          for (int64_t d = 0; d < Dh; ++d) oa[b][i][h * Dh + d] += p * va[b][j][h / group][d];
        }
      }
  return out;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

constexpr int64_t E = 1;  // the delimiter in these tests

}  // namespace

// Rows cut at the delimiter: closing tokens end their document, opening ones start theirs; every
// row starts a piece; a delimiter first or last in a row; two in a row; a row without any.
TEST(Documents, RowsAreCutAtTheDelimiter) {
  int64_t max_len = 0;
  const std::vector<std::vector<int64_t>> rows = {{5, 6, E, 7, E, E, 8, 9}, {E, 4, 4, 4, 4, 4, 4, E}, {3, 3, 3, 3, 3, 3, 3, 3}};
  at::Tensor closes = cu_of(rows, {E, false}, max_len);
  EXPECT_TRUE(at::equal(closes, at::tensor(std::vector<int32_t>{0, 3, 5, 6, 8, 9, 16, 24}, at::kInt))) << closes;
  EXPECT_EQ(max_len, 8);
  at::Tensor opens = cu_of(rows, {E, true}, max_len);
  EXPECT_TRUE(at::equal(opens, at::tensor(std::vector<int32_t>{0, 2, 4, 5, 8, 15, 16, 24}, at::kInt))) << opens;
  EXPECT_EQ(max_len, 8);
}

TEST(Documents, DelimiterFromMakeShardsMetaJson) {
  const std::string dir = "/tmp/zb_meta_" + std::to_string(::getpid());
  make_directories(dir + "/train");
  auto write = [&](const std::string& text) { std::ofstream(dir + "/meta.json") << text; };
  write(R"({"vocab_size": 1024, "eos": 0, "bos": null})");
  auto d = delimiter_from_meta((dir + "/train"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->token, 0);
  EXPECT_FALSE(d->opens);
  write(R"({"eos": 0, "document_token": 50256, "document_token_position": "opens"})");
  d = delimiter_from_meta((dir + "/train") + "/");
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->token, 50256);
  EXPECT_TRUE(d->opens);
  write(R"({"document_token": 3, "document_token_position": "middle"})");
  try {
    delimiter_from_meta((dir + "/train"));
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("meta.json: \"document_token_position\" must be"), std::string::npos) << e.what();
  }
  remove_tree(dir + "/meta.json");
  EXPECT_FALSE(delimiter_from_meta((dir + "/train")).has_value());
  remove_tree(dir);
}

// Rows with one document, two, many (pieces of one token included), a document continuing from
// the row before; multi-head and grouped-query.
TEST(Attention, DocumentMaskEqualsNaiveFloat64) {
  at::manual_seed(3);
  const int64_t T = 12, H = 4, Dh = 8;
  const std::vector<std::vector<int64_t>> rows = {
      {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},  // one document (or the middle of a long one)
      {3, 3, 3, 3, 3, E, 3, 3, 3, 3, 3, 3},  // two
      {E, 3, E, E, 3, 3, E, 3, 3, 3, E, 3},  // many, some of one token
  };
  const int64_t B = static_cast<int64_t>(rows.size());
  for (bool opens : {false, true})
    for (int64_t Hkv : {H, int64_t{2}}) {
      const DocumentDelimiter delimiter{E, opens};
      // Document ids by the rule itself: a new document at p when p opens one or p - 1 closed one.
      std::vector<std::vector<int64_t>> doc(B, std::vector<int64_t>(T, 0));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t p = 1; p < T; ++p)
          doc[b][p] = doc[b][p - 1] + ((opens ? rows[b][p] : rows[b][p - 1]) == E ? 1 : 0);
      at::Tensor q = at::randn({B, T, H, Dh}, at::kDouble), k = at::randn({B, T, Hkv, Dh}, at::kDouble),
                 v = at::randn({B, T, Hkv, Dh}, at::kDouble);
      int64_t max_len = 0;
      const at::Tensor cu = cu_of(rows, delimiter, max_len);
      const Documents docs = make_documents(cu, max_len, T, at::kCPU, at::kDouble, false);
      at::Tensor got = attention(q, k, v, docs);
      at::Tensor want = naive_attention(q, k, v, [&](int64_t b, int64_t i, int64_t j) {
        return j <= i && doc[b][i] == doc[b][j];
      });
      EXPECT_LT(max_abs_diff(got, want), 1e-12) << "opens " << opens << " Hkv " << Hkv;
      // Without documents: causal over the whole row.
      at::Tensor causal = naive_attention(q, k, v, [](int64_t, int64_t i, int64_t j) { return j <= i; });
      EXPECT_LT(max_abs_diff(attention(q, k, v), causal), 1e-12);
      // The one-document row is the same either way; the others are not.
      EXPECT_LT(max_abs_diff(got[0], causal[0]), 1e-12);
      EXPECT_GT(max_abs_diff(got[2], causal[2]), 1e-3);
    }
}

// d(sum(out * w)) / d(q, k, v) against central differences, float64.
TEST(Attention, DocumentMaskGradientsEqualFiniteDifferences) {
  at::manual_seed(4);
  const int64_t T = 7, H = 4, Hkv = 2, Dh = 4;
  const std::vector<std::vector<int64_t>> rows = {{3, 3, E, 3, 3, 3, E}, {E, 3, 3, 3, E, 3, 3}};
  const int64_t B = 2;
  int64_t max_len = 0;
  const at::Tensor cu = cu_of(rows, {E, false}, max_len);
  const Documents docs = make_documents(cu, max_len, T, at::kCPU, at::kDouble, false);
  at::Tensor q = at::randn({B, T, H, Dh}, at::kDouble).requires_grad_(true);
  at::Tensor k = at::randn({B, T, Hkv, Dh}, at::kDouble).requires_grad_(true);
  at::Tensor v = at::randn({B, T, Hkv, Dh}, at::kDouble).requires_grad_(true);
  at::Tensor w = at::randn({B, T, H * Dh}, at::kDouble);
  (attention(q, k, v, docs) * w).sum().backward();
  const double h = 1e-6;
  for (at::Tensor* x : {&q, &k, &v}) {
    at::Tensor flat = x->detach().view(-1), grad = x->grad().view(-1);
    for (int64_t i = 0; i < flat.numel(); i += 3) {
      at::NoGradGuard no_grad;
      const double saved = flat[i].item<double>();
      flat[i].fill_(saved + h);
      const double up = (attention(q, k, v, docs) * w).sum().item<double>();
      flat[i].fill_(saved - h);
      const double down = (attention(q, k, v, docs) * w).sum().item<double>();
      flat[i].fill_(saved);
      EXPECT_NEAR(grad[i].item<double>(), (up - down) / (2 * h), 1e-7) << i;
    }
  }
}

TEST(Attention, KernelIsReportedAndCanBeChosen) {
  // The dispatcher's own answer for the shapes attention hands it: here the CPU's flash kernel
  // or the unfused math, whatever the mask; forcing "math" must make it the math one, and the
  // result of attention stays the same to fp32 rounding.
  const c10::Device cpu(c10::kCPU);
  const std::string automatic = attention_kernel(cpu, at::kFloat, 64, 4, 2, 16, /*document_mask=*/false, false);
  EXPECT_TRUE(automatic == "flash_attention" || automatic == "math") << automatic;
  EXPECT_EQ(attention_kernel(cpu, at::kFloat, 64, 4, 2, 16, true, /*flash_documents=*/true), "flash_varlen");
  at::manual_seed(3);
  const at::Tensor q = at::randn({2, 64, 4, 16}), k = at::randn({2, 64, 2, 16}), v = at::randn({2, 64, 2, 16});
  const at::Tensor before = attention(q, k, v);
  use_sdpa_backend("math");
  EXPECT_EQ(attention_kernel(cpu, at::kFloat, 64, 4, 2, 16, false, false), "math");
  EXPECT_EQ(attention_kernel(cpu, at::kFloat, 64, 4, 2, 16, true, false), "math");
  const at::Tensor forced = attention(q, k, v);
  use_sdpa_backend("auto");
  EXPECT_EQ(attention_kernel(cpu, at::kFloat, 64, 4, 2, 16, false, false), automatic);
  EXPECT_LT((forced - before).abs().max().item<double>(), 1e-5);
  EXPECT_THROW(use_sdpa_backend("fast"), std::invalid_argument);
  // runtime.varlen_kernel: the documents' kernel reported as cuDNN's when chosen; the CPU's mask
  // path is not affected.
  EXPECT_EQ(attention_kernel(cpu, at::kFloat, 64, 4, 2, 16, true, /*flash_documents=*/true, /*cudnn_varlen=*/true),
            "cudnn_varlen");
  EXPECT_NE(attention_kernel(cpu, at::kFloat, 64, 4, 2, 16, true, false, /*cudnn_varlen=*/true), "cudnn_varlen");
  EXPECT_EQ(attention_kernel(cpu, at::kFloat, 64, 4, 2, 16, true, true, /*cudnn_varlen=*/false), "flash_varlen");
}

TEST(Attention, CudnnVarlenLengthsComeInPowersOfTwo) {
  // For cuDNN's forward the cumulative lengths are padded with empty sequences to a power of two
  // (cuDNN builds a graph per count and longest, and attention() gives it T as the longest); flash's
  // backward reads the real ones, a view of their start, with the real longest. Made for the CPU
  // here (make_documents does not look at the device for these).
  const at::Tensor cu = at::tensor(std::vector<int32_t>{0, 5, 16, 20, 32}, at::kInt);  // 4 pieces, 2 rows of 16
  const at::Tensor odd = at::tensor(std::vector<int32_t>{0, 5, 16, 32}, at::kInt);     // 3 pieces
  const c10::Device cpu(c10::kCPU);
  const Documents four = make_documents(cu, 12, 16, cpu, at::kFloat, /*flash=*/true, /*cudnn_varlen=*/true);
  const Documents three = make_documents(odd, 16, 16, cpu, at::kFloat, true, true);
  const Documents flash = make_documents(odd, 16, 16, cpu, at::kFloat, true, /*cudnn_varlen=*/false);
  EXPECT_TRUE(at::equal(four.cudnn_cu_seqlens, cu));
  EXPECT_TRUE(at::equal(four.cu_seqlens, cu));
  EXPECT_EQ(four.max_len, 12);
  EXPECT_TRUE(at::equal(three.cudnn_cu_seqlens, at::tensor(std::vector<int32_t>{0, 5, 16, 32, 32}, at::kInt)));
  EXPECT_TRUE(at::equal(three.cu_seqlens, odd));
  EXPECT_EQ(three.cu_seqlens.data_ptr(), three.cudnn_cu_seqlens.data_ptr());
  EXPECT_EQ(three.max_len, 16);
  EXPECT_TRUE(at::equal(flash.cu_seqlens, odd));
  EXPECT_FALSE(flash.cudnn_cu_seqlens.defined());
  EXPECT_EQ(flash.max_len, 16);
}

// Context parallelism through the variable-length kernel (runtime.cp_varlen): the pieces and
// packed keys of cp_varlen_documents, attended the way the flash kernel attends them (each
// piece's n queries see all but the last n-1-i of its keys, the causal mask aligned at the end),
// give every query what the mask of cp_documents gives it, in float64. The kernel itself runs
// only on a GPU (cuda.CudaAttention.CpVarlenEqualsTheMask).
TEST(Attention, CpVarlenPiecesSeeWhatTheMaskSees) {
  at::manual_seed(11);
  const int64_t B = 2, T = 48, H = 4, Hkv = 2, Dh = 8;
  // Documents shorter than a chunk, across chunk edges, and one longer than a row (from row 0 into 1).
  const at::Tensor cu = at::tensor(std::vector<int32_t>{0, 5, 7, 30, 48, 60, 61, 96}, at::kInt);
  for (const int64_t size : {2, 3, 4})
    for (const bool documents : {true, false})
      for (int64_t rank = 0; rank < size; ++rank) {
        const int64_t t = T / size;
        const at::Tensor q = at::randn({B, t, H, Dh}, at::kDouble), k = at::randn({B, T, Hkv, Dh}, at::kDouble),
                         v = at::randn({B, T, Hkv, Dh}, at::kDouble);
        const at::Tensor cus = documents ? cu : at::Tensor();
        const at::Tensor want = attention(q, k, v, cp_documents(cus, B, T, rank, size, at::kCPU, at::kDouble));
        const Documents d = cp_varlen_documents(cus, B, T, rank, size, at::kCPU);
        ASSERT_EQ(d.cu_seqlens[-1].item<int64_t>(), B * t);
        ASSERT_EQ(d.cu_seqlens_k.numel(), d.cu_seqlens.numel());
        const at::Tensor qf = q.reshape({B * t, H, Dh}), kf = k.reshape({B * T, Hkv, Dh}).index_select(0, d.key_index),
                         vf = v.reshape({B * T, Hkv, Dh}).index_select(0, d.key_index);
        at::Tensor got = at::empty({B * t, H, Dh}, at::kDouble);
        for (int64_t j = 0; j + 1 < d.cu_seqlens.numel(); ++j) {
          const int64_t q0 = d.cu_seqlens[j].item<int64_t>(), nq = d.cu_seqlens[j + 1].item<int64_t>() - q0;
          const int64_t k0 = d.cu_seqlens_k[j].item<int64_t>(), nk = d.cu_seqlens_k[j + 1].item<int64_t>() - k0;
          ASSERT_GE(nk, nq);
          ASSERT_LE(nq, d.max_len);
          ASSERT_LE(nk, d.max_len_k);
          const at::Tensor qs = qf.narrow(0, q0, nq).transpose(0, 1);                                   // [H, nq, Dh]
          const at::Tensor ks = kf.narrow(0, k0, nk).repeat_interleave(H / Hkv, 1).transpose(0, 1);  // [H, nk, Dh]
          const at::Tensor vs = vf.narrow(0, k0, nk).repeat_interleave(H / Hkv, 1).transpose(0, 1);
          at::Tensor scores = at::matmul(qs, ks.transpose(1, 2)) / std::sqrt(static_cast<double>(Dh));
          const at::Tensor qi = at::arange(nq, at::kLong).unsqueeze(1), ki = at::arange(nk, at::kLong).unsqueeze(0);
          scores = scores.masked_fill(ki.gt(qi + (nk - nq)), -INFINITY);  // aligned at the end
          got.narrow(0, q0, nq).copy_(at::matmul(at::softmax(scores, -1), vs).transpose(0, 1));
        }
        EXPECT_LT((got.reshape({B, t, H * Dh}) - want).abs().max().item<double>(), 1e-12)
            << "cp " << size << " rank " << rank << (documents ? " documents" : " causal");
      }
}
