// Token shards and the loader: the text-to-shards tool round trip, llm.c files written
// independently, the same global batches on any world size, exact resume, and bad inputs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "config/config.h"
#include "data/loader.h"
#include "data/token_dataset.h"
#include "data/token_shard.h"

using namespace zb;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/zb_data_XXXXXX";
  return ::mkdtemp(tmpl);
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string read_file(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  return ss.str();
}

// An llm.c shard written field by field, independently of write_token_shard.
void write_llmc_shard(const std::string& path, const std::vector<uint32_t>& tokens, bool wide) {
  int32_t header[256] = {};
  header[0] = wide ? 20240801 : 20240520;
  header[1] = wide ? 7 : 1;
  header[2] = static_cast<int32_t>(tokens.size());
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(header, 4, 256, f);
  for (uint32_t t : tokens) {
    if (wide) std::fwrite(&t, 4, 1, f);
    else {
      uint16_t v = static_cast<uint16_t>(t);
      std::fwrite(&v, 2, 1, f);
    }
  }
  std::fclose(f);
}

// Row i of sample s is s * 100 + i: easy to check.
struct FakeDatasetForTest : SampleSource {
  int64_t num_samples() const override { return -1; }
  int64_t seq_len() const override { return 4; }
  void sample(int64_t index, int64_t* row) const override {
    for (int i = 0; i < 5; ++i) row[i] = index * 100 + i;
  }
};

// Every token of every sample is `value`.
struct ConstantSource : SampleSource {
  explicit ConstantSource(int64_t v) : value(v) {}
  int64_t value;
  int64_t num_samples() const override { return 10; }
  int64_t seq_len() const override { return 4; }
  void sample(int64_t, int64_t* row) const override { std::fill(row, row + 5, value); }
};

template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(TokenData, TextToShardsToLoaderRoundTrip) {
  const std::string dir = temp_dir();
  const std::string docs[] = {"The quick brown fox jumps over the lazy dog.\nTwice, even.",
                              "Pretraining needs tokens; shards hold them.",
                              "Line one of JSON", "Line two: unicode \u00e9\u00e8 \u2713",
                              "Parquet row one.", "Parquet row two."};
  write_file(dir + "/a.txt", docs[0]);
  write_file(dir + "/b.txt", docs[1]);
  write_file(dir + "/c.jsonl", "{\"text\": \"" + docs[2] + "\"}\n{\"text\": \"Line two: unicode \\u00e9\\u00e8 \\u2713\"}\n");
  // And a parquet file with a "text" column (written by pyarrow, read by the tool).
  const std::string parquet = std::string(ZB_PYTHON) +
      " -c \"import pyarrow as pa, pyarrow.parquet as pq; pq.write_table(pa.table({'text': "
      "['Parquet row one.', 'Parquet row two.']}), '" + dir + "/d.parquet')\"";
  ASSERT_EQ(std::system(parquet.c_str()), 0);
  const std::string out = dir + "/out";
  // Tiny shards (40 tokens) so that documents straddle shard boundaries; no validation split.
  const std::string cmd = std::string(ZB_PYTHON) + " " + ZB_SOURCE_DIR + "/scripts/data/make_shards.py " +
                          out + " " + dir + "/a.txt " + dir + "/b.txt " + dir + "/c.jsonl " + dir + "/d.parquet" +
                          " --train-vocab 300 --val-fraction 0 --shard-tokens 40 > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;

  // 1. All shards in order, decoded, give the documents separated by the end-of-text token.
  const auto paths = list_shards(out + "/train");
  ASSERT_GT(paths.size(), 1u);
  std::vector<int64_t> all;
  for (const auto& p : paths) {
    TokenShard s(p);
    std::vector<int64_t> t(static_cast<size_t>(s.num_tokens()));
    s.read(0, s.num_tokens(), t.data());
    all.insert(all.end(), t.begin(), t.end());
  }
  {
    std::ofstream f(dir + "/tokens.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(all.data()), static_cast<std::streamsize>(all.size() * 8));
  }
  const std::string decode = std::string(ZB_PYTHON) + " " + ZB_SOURCE_DIR + "/tests/reference/decode_tokens.py " +
                             out + "/tokenizer.json " + dir + "/tokens.bin " + dir + "/decoded.txt";
  ASSERT_EQ(std::system(decode.c_str()), 0);
  std::string expected;
  for (const auto& d : docs) expected += d + "<|endoftext|>";
  EXPECT_EQ(read_file(dir + "/decoded.txt"), expected);

  // 2. The loader's samples are windows of each shard: sample k of a shard = tokens
  //    [k*T, k*T + T] (inputs) shifted by one (targets).
  const int64_t T = 8;
  auto data = std::make_shared<TokenDataset>(out + "/train", T, 300);
  DataLoader loader(data, 0, /*shuffle=*/false, 1, 1, 0, 1);
  int64_t offset_of_shard = 0, expected_samples = 0;
  for (const auto& s : data->shards()) {
    for (int64_t k = 0; k < (s.num_tokens() - 1) / T; ++k) {
      Batch b = loader.next();
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(b.inputs[0][t].item<int64_t>(), all[offset_of_shard + k * T + t]);
        EXPECT_EQ(b.targets[0][t].item<int64_t>(), all[offset_of_shard + k * T + t + 1]);
      }
      ++expected_samples;
    }
    offset_of_shard += s.num_tokens();
  }
  EXPECT_EQ(data->num_samples(), expected_samples);
  std::system(("rm -rf " + dir).c_str());
}

TEST(TokenData, ReadsLlmcShardsOfBothWidths) {
  const std::string dir = temp_dir();
  std::vector<uint32_t> narrow(100), wide(100);
  for (uint32_t i = 0; i < 100; ++i) narrow[i] = (i * 7919u) % 50257u, wide[i] = 100000u + i * 1000u;
  write_llmc_shard(dir + "/a.bin", narrow, false);
  write_llmc_shard(dir + "/b.bin", wide, true);
  TokenShard a(dir + "/a.bin"), b(dir + "/b.bin");
  EXPECT_EQ(a.bytes_per_token(), 2);
  EXPECT_EQ(b.bytes_per_token(), 4);
  std::vector<int64_t> ta(100), tb(100);
  a.read(0, 100, ta.data());
  b.read(0, 100, tb.data());
  for (size_t i = 0; i < 100; ++i) {
    EXPECT_EQ(ta[i], narrow[i]);
    EXPECT_EQ(tb[i], wide[i]);
  }
  // Our writer produces the same bytes as the independent one.
  write_token_shard(dir + "/c.bin", std::vector<int64_t>(narrow.begin(), narrow.end()));
  EXPECT_EQ(read_file(dir + "/c.bin"), read_file(dir + "/a.bin"));
  // A directory lists its shards in order; a dataset of both reads with a 256k vocabulary.
  TokenDataset d(dir, 9, 256000);
  EXPECT_EQ(d.shards().size(), 3u);
  EXPECT_EQ(d.num_samples(), 3 * (99 / 9));
  std::system(("rm -rf " + dir).c_str());
}

TEST(TokenData, SameGlobalBatchesOnOneTwoFourRanksAndExactResume) {
  const std::string dir = temp_dir();
  std::vector<int64_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 31) % 1000);
  write_token_shard(dir + "/s0.bin", tokens);
  write_token_shard(dir + "/s1.bin", std::vector<int64_t>(tokens.begin(), tokens.begin() + 3001));
  auto data = std::make_shared<TokenDataset>(dir, 16, 1000);  // 312 + 187 samples
  const int64_t B = 8, steps = 70;                            // > one epoch
  auto global_batches = [&](int64_t world, int64_t micro_bs) {
    std::vector<at::Tensor> per_step(steps);
    for (int64_t r = 0; r < world; ++r) {
      DataLoader d(data, 42, /*shuffle=*/true, B, micro_bs, r, world);
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t m = 0; m < B / world / micro_bs; ++m) {
          at::Tensor rows = d.next().inputs;
          per_step[s] = per_step[s].defined() ? at::cat({per_step[s], rows}) : rows;
        }
    }
    return per_step;
  };
  auto one = global_batches(1, 4), two = global_batches(2, 2), four = global_batches(4, 1);
  for (int64_t s = 0; s < steps; ++s) {
    EXPECT_TRUE(at::equal(one[s], two[s])) << "step " << s;
    EXPECT_TRUE(at::equal(one[s], four[s])) << "step " << s;
  }
  // Shuffled: not the file order. And epoch 2 is another permutation.
  DataLoader plain(data, 42, false, B, B, 0, 1);
  EXPECT_FALSE(at::equal(plain.next().inputs, one[0]));
  DataLoader probe(data, 42, true, B, B, 0, 1);
  EXPECT_NE(probe.sample_at(0), probe.sample_at(data->num_samples()));

  // Resume: a fresh loader given the state after 23 micro-batches continues exactly.
  DataLoader a(data, 42, true, B, 2, 1, 2);
  for (int i = 0; i < 23; ++i) a.next();
  const LoaderState saved = a.state();
  DataLoader b(data, 42, true, B, 2, 1, 2);
  b.load_state(saved);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(at::equal(a.next().inputs, b.next().inputs)) << i;
  DataLoader other_world(data, 42, true, B, 2, 1, 4);
  EXPECT_EQ(error_of([&] { other_world.load_state(saved); }),
            "data loader state from seed 42 on 2 ranks cannot resume seed 42 on 4 ranks");
  std::system(("rm -rf " + dir).c_str());
}

TEST(TokenData, BadInputsNameTheFile) {
  const std::string dir = temp_dir();
  EXPECT_EQ(error_of([&] { TokenDataset(dir + "/missing", 8, 1024); }),
            "dataset path " + dir + "/missing does not exist");
  write_file(dir + "/notes.bin", std::string(2000, 'x'));
  EXPECT_NE(error_of([&] { TokenShard s(dir + "/notes.bin"); })
                .find("token shard " + dir + "/notes.bin: not a token shard (magic"),
            std::string::npos);
  write_file(dir + "/tiny.bin", "abc");
  EXPECT_EQ(error_of([&] { TokenShard s(dir + "/tiny.bin"); }),
            "token shard " + dir + "/tiny.bin: not a token shard (3 bytes, shorter than the 1024-byte header)");
  std::vector<int64_t> tokens(100, 5);
  write_token_shard(dir + "/cut.bin", tokens);
  ::truncate((dir + "/cut.bin").c_str(), 1024 + 150);
  EXPECT_EQ(error_of([&] { TokenShard s(dir + "/cut.bin"); }),
            "token shard " + dir + "/cut.bin: truncated or damaged: the header promises 100 tokens "
            "(1224 bytes) but the file has 1174 bytes");
  tokens[40] = 2000;
  write_token_shard(dir + "/big.bin", tokens);
  EXPECT_EQ(error_of([&] { TokenDataset(dir + "/big.bin", 8, 1024); }),
            "token shard " + dir + "/big.bin: token id 2000 is not below the model's vocabulary of "
            "1024 (wrong tokenizer for this model?)");
  write_token_shard(dir + "/short.bin", std::vector<int64_t>(5, 1));
  EXPECT_EQ(error_of([&] { TokenDataset(dir + "/short.bin", 8, 1024); }),
            "dataset " + dir + "/short.bin: its 5 tokens make no sample of seq_length + 1 = 9 tokens");
  const std::string empty = dir + "/empty";
  ::mkdir(empty.c_str(), 0755);
  EXPECT_EQ(error_of([&] { TokenDataset(empty, 8, 1024); }),
            "dataset directory " + empty + " holds no *.bin token shard");
  std::system(("rm -rf " + dir).c_str());
}

TEST(TokenData, PrefetchingChangesNothingAndResumes) {
  auto fake = std::make_shared<FakeDatasetForTest>();
  DataLoader plain(fake, 1, false, 8, 2, 1, 2), ahead(fake, 1, false, 8, 2, 1, 2);
  ahead.start_prefetch(3, /*pin_memory=*/false);
  for (int i = 0; i < 12; ++i) EXPECT_TRUE(at::equal(plain.next().inputs, ahead.next().inputs)) << i;
  const LoaderState saved = ahead.state();
  EXPECT_EQ(saved.rows_consumed, 24);
  DataLoader resumed(fake, 1, false, 8, 2, 1, 2);
  resumed.start_prefetch(2, false);
  resumed.load_state(saved);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(at::equal(plain.next().inputs, resumed.next().inputs)) << i;
}

// Sample i of source `id` is the row (id, i, i, i, i).
struct NumberedSource : SampleSource {
  NumberedSource(int64_t id, int64_t n) : id(id), n(n) {}
  int64_t id, n;
  int64_t num_samples() const override { return n; }
  int64_t seq_len() const override { return 4; }
  void sample(int64_t index, int64_t* row) const override {
    row[0] = id;
    std::fill(row + 1, row + 5, index);
  }
};

TEST(TokenData, MixingByRatio) {
  // 70:30 over sources of 3001 and 997 samples (neither divides a block of 4096 positions).
  auto a = std::make_shared<NumberedSource>(0, 3001), b = std::make_shared<NumberedSource>(1, 997);
  MixedSource mix({a, b}, parse_ratio("70:30", 2), 5);
  const int64_t n = 3 * MixedSource::kBlock + 123;
  std::vector<std::vector<int64_t>> read(2);  // each source's samples in the order read
  std::vector<int64_t> row(5);
  for (int64_t i = 0; i < n; ++i) {
    mix.sample(i, row.data());
    const auto [s, k] = mix.source_of(i);
    ASSERT_EQ(row[0], static_cast<int64_t>(s)) << i;
    ASSERT_EQ(k, static_cast<int64_t>(read[s].size())) << i;  // a source's reads counted in order
    read[s].push_back(row[1]);
    // Exact shares at every block's end: floor(N x 0.7) of the first N positions from a.
    if ((i + 1) % MixedSource::kBlock == 0)
      EXPECT_EQ(static_cast<int64_t>(read[0].size()), static_cast<int64_t>(std::floor((i + 1) * 0.7))) << i;
  }
  // Without replacement: each pass over a source reads every sample once, in an order of its own.
  for (size_t s = 0; s < 2; ++s) {
    const int64_t size = s == 0 ? 3001 : 997;
    ASSERT_GE(static_cast<int64_t>(read[s].size()), size + 2);
    std::vector<int64_t> first(read[s].begin(), read[s].begin() + size);
    std::sort(first.begin(), first.end());
    for (int64_t i = 0; i < size; ++i) ASSERT_EQ(first[static_cast<size_t>(i)], i) << "source " << s;
    EXPECT_NE(std::vector<int64_t>(read[s].begin(), read[s].begin() + 2),
              std::vector<int64_t>(read[s].begin() + size, read[s].begin() + size + 2));  // a new order
  }
  // The same from the seed alone, read in any order (a resumed or repositioned loader).
  MixedSource again({a, b}, parse_ratio("70:30", 2), 5);
  for (int64_t i = n - 1; i >= n - 200; --i) EXPECT_EQ(again.source_of(i), mix.source_of(i)) << i;
  EXPECT_EQ(error_of([] { parse_ratio("4096:1", 2); }),
            "dataset_ratio \"4096:1\": a part below 1/2048 of the total (1 of 4097)");
  EXPECT_EQ(error_of([] { parse_ratio("70:x", 2); }), "dataset_ratio \"70:x\": 'x' is not a positive number");
  EXPECT_EQ(error_of([] { parse_ratio("1:1:1", 2); }), "dataset_ratio \"1:1:1\" has 3 parts for 2 datasets");
}
