// bench_loader: how fast the data loader produces micro-batches, with and without the
// background prefetch thread, for comparison with what training consumes.
//
//   bench_loader [--data data/python-docs/train] [--seq-length 1024] [--micro-bs 32]
//                [--batches 300]
#include <ATen/Parallel.h>
#include <cxxopts.hpp>

#include <chrono>
#include <cstdio>
#include <memory>

#include "data/loader.h"
#include "data/token_dataset.h"

int main(int argc, char** argv) {
  cxxopts::Options options("bench_loader", "data loader throughput");
  options.add_options()
      ("data", "token shards (files or directories, comma-separated)",
       cxxopts::value<std::string>()->default_value("data/python-docs/train"))
      ("seq-length", "tokens per sample", cxxopts::value<int64_t>()->default_value("1024"))
      ("micro-bs", "samples per micro-batch", cxxopts::value<int64_t>()->default_value("32"))
      ("batches", "micro-batches to time", cxxopts::value<int64_t>()->default_value("300"))
      ("h,help", "print this help");
  const auto args = options.parse(argc, argv);
  if (args.count("help")) {
    std::printf("%s", options.help().c_str());
    return 0;
  }
  const int64_t T = args["seq-length"].as<int64_t>(), B = args["micro-bs"].as<int64_t>();
  const int64_t n = args["batches"].as<int64_t>();
  auto data = std::make_shared<zb::TokenDataset>(args["data"].as<std::string>(), T, 1 << 30);
  std::printf("dataset: %ld tokens, %ld samples of %ld tokens; micro-batch %ld; %d threads\n",
              data->num_tokens(), data->num_samples(), T + 1, B, at::get_num_threads());
  for (int prefetch : {0, 4}) {
    zb::DataLoader loader(data, 42, /*shuffle=*/true, B, B, 0, 1);
    loader.start_prefetch(prefetch, false);
    loader.next();  // warm up
    const auto start = std::chrono::steady_clock::now();
    int64_t checksum = 0;
    for (int64_t i = 0; i < n; ++i) checksum += loader.next().inputs[0][0].item<int64_t>();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("prefetch %d: %ld micro-batches in %.3f s = %.0f tokens/s (checksum %ld)\n", prefetch,
                n, s, static_cast<double>(n * B * T) / s, checksum);
  }
  return 0;
}
