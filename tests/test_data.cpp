// Fake data: well-formed rows, deterministic, and the same global batch for any world size.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "data/fake_data.h"

#include <algorithm>
#include <memory>
#include <vector>

using namespace zb;

TEST(FakeData, RowsAreShiftedTokensWithEos) {
  DataLoader d(std::make_shared<FakeDataset>(42, 64, 1024), 0, false, 8, 4, 0, 1);
  Batch b = d.next();
  ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{4, 64}));
  EXPECT_TRUE(at::equal(b.inputs.slice(1, 1), b.targets.slice(1, 0, 63)));
  EXPECT_GE(b.inputs.min().item<int64_t>(), 1);
  EXPECT_LT(b.inputs.max().item<int64_t>(), 1024);
  EXPECT_GT((b.inputs == FakeDataset::kEos).sum().item<int64_t>(), 0);  // documents end
  EXPECT_EQ(((b.inputs == 0) | (b.inputs == 2)).sum().item<int64_t>(), 0);
}

TEST(FakeData, SameGlobalBatchForOneTwoFourRanks) {
  const int64_t T = 32, B = 8, steps = 3;
  auto global_batches = [&](int64_t world, int64_t micro_bs) {
    // Rank r's micro-batches of step s, concatenated in rank order, form the global batch.
    std::vector<at::Tensor> per_step(steps);
    for (int64_t r = 0; r < world; ++r) {
      DataLoader d(std::make_shared<FakeDataset>(7, T, 1024), 0, false, B, micro_bs, r, world);
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t m = 0; m < B / world / micro_bs; ++m) {
          at::Tensor rows = d.next().inputs;
          per_step[s] = per_step[s].defined() ? at::cat({per_step[s], rows}) : rows;
        }
    }
    return per_step;
  };
  auto one = global_batches(1, 2), two = global_batches(2, 2), four = global_batches(4, 1);
  for (int64_t s = 0; s < steps; ++s) {
    EXPECT_TRUE(at::equal(one[s], two[s])) << "step " << s;
    EXPECT_TRUE(at::equal(one[s], four[s])) << "step " << s;
  }
  EXPECT_FALSE(at::equal(one[0], one[1]));  // steps differ
  DataLoader other_seed(std::make_shared<FakeDataset>(8, T, 1024), 0, false, B, 2, 0, 1);
  EXPECT_FALSE(at::equal(other_seed.next().inputs, one[0].slice(0, 0, 2)));
}

// With a delimiter the loader hands each batch its documents: every row cut after each EOS,
// pieces covering the micro-batch in order, the same whether made ahead on the prefetching thread
// or on demand; a document left open at a row's end goes on as the next row's first piece.
TEST(FakeData, BatchesCarryTheirDocuments) {
  const int64_t T = 64, micro = 4;
  auto loader = [&](int depth) {
    auto d = std::make_unique<DataLoader>(std::make_shared<FakeDataset>(3, T, 1024), 0, false, 16, micro, 0, 1);
    d->set_documents({FakeDataset::kEos, /*opens=*/false});
    d->start_prefetch(depth, false);
    return d;
  };
  auto ahead = loader(3), on_demand = loader(0);
  int64_t continued = 0;
  for (int i = 0; i < 6; ++i) {
    const Batch a = ahead->next(), b = on_demand->next();
    ASSERT_TRUE(at::equal(a.inputs, b.inputs));
    ASSERT_TRUE(at::equal(a.cu_seqlens, b.cu_seqlens));
    EXPECT_EQ(a.max_document, b.max_document);
    // The expected cuts, from the tokens: row starts, and after every EOS but a row's last token.
    std::vector<int32_t> want{0};
    int64_t longest = 0, start = 0;
    for (int64_t r = 0; r < micro; ++r) {
      for (int64_t p = 1; p <= T; ++p) {
        const bool cut = p == T || a.inputs[r][p - 1].item<int64_t>() == FakeDataset::kEos;
        if (!cut) continue;
        want.push_back(static_cast<int32_t>(r * T + p));
        longest = std::max(longest, r * T + p - start);
        start = r * T + p;
      }
      continued += a.inputs[r][T - 1].item<int64_t>() != FakeDataset::kEos;
    }
    EXPECT_TRUE(at::equal(a.cu_seqlens, at::tensor(want, at::kInt))) << a.cu_seqlens;
    EXPECT_EQ(a.max_document, longest);
  }
  EXPECT_GT(continued, 0);  // some documents do run from one row into the next
}
