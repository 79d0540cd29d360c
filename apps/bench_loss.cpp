// The chunked loss (model/chunked_loss.h) alone: forward and backward of the head's product and
// the cross-entropy for one micro-batch, timed over repeats, on the CPU or a GPU.
//
//   bench_loss [--tokens 4096] [--dim 256] [--vocab 32000] [--dtype float32|bfloat16] [--device cpu|cuda]
//              [--repeats 5]
//
// Prints the median seconds per forward+backward and the tokens per second.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <c10/core/Device.h>
#include <cxxopts.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "model/chunked_loss.h"

int main(int argc, char** argv) {
  cxxopts::Options options("bench_loss", "times the chunked loss's forward and backward");
  options.add_options()("tokens", "tokens", cxxopts::value<int64_t>()->default_value("4096"))(
      "dim", "model width", cxxopts::value<int64_t>()->default_value("256"))(
      "vocab", "vocabulary", cxxopts::value<int64_t>()->default_value("32000"))(
      "dtype", "float32 or bfloat16", cxxopts::value<std::string>()->default_value("float32"))(
      "device", "cpu or cuda", cxxopts::value<std::string>()->default_value("cpu"))(
      "repeats", "timed repeats", cxxopts::value<int>()->default_value("5"));
  const auto args = options.parse(argc, argv);
  const int64_t N = args["tokens"].as<int64_t>(), D = args["dim"].as<int64_t>(), V = args["vocab"].as<int64_t>();
  const c10::Device device(args["device"].as<std::string>());
  const auto dtype = args["dtype"].as<std::string>() == "bfloat16" ? at::kBFloat16 : at::kFloat;
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  at::manual_seed(0);
  const at::Tensor x = at::randn({N, D}, opts).requires_grad_(true);
  const at::Tensor w = (at::randn({V, D}, opts) * 0.02).detach().requires_grad_(true);
  const at::Tensor targets = at::randint(V, {N}, at::TensorOptions().device(device).dtype(at::kLong));
  const int64_t chunk = zb::loss_chunk_tokens(V, device.is_cuda());
  auto once = [&] {
    at::Tensor loss = zb::chunked_cross_entropy(x, w, targets, chunk);
    loss.backward();
    (void)loss.item<double>();  // waits for the device
  };
  once();  // warm-up
  std::vector<double> seconds;
  for (int r = 0; r < args["repeats"].as<int>(); ++r) {
    const auto start = std::chrono::steady_clock::now();
    once();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  std::printf("chunked loss N=%ld D=%ld V=%ld %s on %s, chunks of %ld tokens, %d threads: %.4f s (median of %zu), "
              "%.0f tokens/s\n",
              static_cast<long>(N), static_cast<long>(D), static_cast<long>(V), c10::toString(dtype),
              device.str().c_str(), static_cast<long>(chunk), at::get_num_threads(), median, seconds.size(),
              static_cast<double>(N) / median);
  return 0;
}
