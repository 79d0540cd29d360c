// Muon's orthogonalisation alone, standard Newton-Schulz against Gram Newton-Schulz
// (optim.optim.ns_algorithm, optim/muon.h), on a preset's hidden matrices: for each shape, the
// batch of that shape one block holds (times --layers) orthogonalised as Muon::orthogonalize_local
// does, timed over repeats, on the CPU or a GPU.
//
//   bench_newton_schulz [--model 1B] [--type_model llama2] [--layers 1] [--coefficients jordan]
//                       [--device cpu|cuda] [--repeats 3]
//
// Each algorithm runs in the precision training gives it: standard in ns_dtype "auto" (bf16 on a
// GPU, fp32 on the CPU), Gram in gram_newton_schulz_dtype of it (fp16 on a GPU). Prints a markdown
// table: per shape the best milliseconds of each (the two taken in turn), their ratio, the ratio of
// multiply-adds the choice reads (newton_schulz_multiply_adds / gram_newton_schulz_multiply_adds),
// whether "gram" takes it, and each result's relative distance (Frobenius) from standard
// Newton-Schulz in float64.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/randn.h>
#include <c10/core/Device.h>
#include <cxxopts.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "model/model_args.h"
#include "optim/muon.h"

namespace {

double run_ms(const std::function<at::Tensor()>& run) {
  const auto start = std::chrono::steady_clock::now();
  (void)run().sum().item<double>();  // item() waits for the device
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The best of `repeats` runs of each, taken in turn (a busy machine slows both alike), after one
// warm-up run of each.
std::pair<double, double> best_ms(const std::function<at::Tensor()>& a, const std::function<at::Tensor()>& b,
                                  int repeats) {
  run_ms(a), run_ms(b);
  double best_a = 1e300, best_b = 1e300;
  for (int r = 0; r < repeats; ++r) best_a = std::min(best_a, run_ms(a)), best_b = std::min(best_b, run_ms(b));
  return {best_a, best_b};
}

double relative_distance(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble).cpu() - want).norm().item<double>() / want.norm().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  cxxopts::Options options("bench_newton_schulz", "times standard against Gram Newton-Schulz on a preset's matrices");
  options.add_options()("model", "preset (name_model)", cxxopts::value<std::string>()->default_value("1B"))(
      "type_model", "llama2 or llama3", cxxopts::value<std::string>()->default_value("llama2"))(
      "layers", "blocks whose matrices go in each batch", cxxopts::value<int64_t>()->default_value("1"))(
      "coefficients", "jordan or polar_express", cxxopts::value<std::string>()->default_value("jordan"))(
      "device", "cpu or cuda", cxxopts::value<std::string>()->default_value("cpu"))(
      "repeats", "timed repeats", cxxopts::value<int>()->default_value("3"));
  const auto args = options.parse(argc, argv);
  const zb::ModelArgs model = zb::lookup_model_args(args["type_model"].as<std::string>(), args["model"].as<std::string>());
  const int64_t layers = args["layers"].as<int64_t>();
  const c10::Device device(args["device"].as<std::string>());
  const zb::NsCoefficients& coefficients = zb::ns_coefficients(args["coefficients"].as<std::string>());
  const int repeats = args["repeats"].as<int>();
  const int64_t steps = 5;
  const at::ScalarType standard_dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  const at::ScalarType gram_dtype = zb::gram_newton_schulz_dtype(standard_dtype);
  at::NoGradGuard no_grad;

  // One block's hidden matrices by shape ([rows, cols] -> how many), as Muon batches them.
  std::map<std::vector<int64_t>, int64_t> per_block;
  for (const zb::ParamSpec& p : zb::param_specs(model))
    if (p.layer == 0 && p.shape.size() == 2) ++per_block[p.shape];

  std::printf("%s %s, %ld block(s) a batch, %s coefficients, on %s (%d threads): standard in %s, Gram in %s\n\n",
              args["type_model"].as<std::string>().c_str(), args["model"].as<std::string>().c_str(),
              static_cast<long>(layers), coefficients.name.c_str(), device.str().c_str(), at::get_num_threads(),
              c10::toString(standard_dtype), c10::toString(gram_dtype));
  std::printf("| shape | batch | standard ms | gram ms | standard / gram | multiply-adds standard / gram | "
              "\"gram\" takes it | distance from float64: standard, gram |\n|---|---|---|---|---|---|---|---|\n");
  at::manual_seed(0);
  for (const auto& [shape, count] : per_block) {
    const int64_t rows = shape[0], cols = shape[1], batch = count * layers;
    const at::Tensor G = at::randn({batch, rows, cols}, at::TensorOptions().device(device));
    const auto [standard_ms, gram_ms] =
        best_ms([&] { return zb::newton_schulz(G, steps, standard_dtype, 1e-7, true, coefficients); },
                [&] { return zb::gram_newton_schulz(G, steps, gram_dtype, 1e-7, true, coefficients); }, repeats);
    // Accuracy on the first matrix of the batch, against the iteration in float64 on the CPU.
    const at::Tensor first = G[0].cpu().to(at::kDouble);
    const at::Tensor exact = zb::newton_schulz(first, steps, at::kDouble, 1e-7, false, coefficients);
    const double standard_error =
        relative_distance(zb::newton_schulz(G[0], steps, standard_dtype, 1e-7, true, coefficients), exact);
    const double gram_error =
        relative_distance(zb::gram_newton_schulz(G[0], steps, gram_dtype, 1e-7, true, coefficients), exact);
    std::printf("| %ld x %ld | %ld | %.1f | %.1f | x%.2f | x%.2f | %s | %.1e, %.1e |\n", static_cast<long>(rows),
                static_cast<long>(cols), static_cast<long>(batch), standard_ms, gram_ms, standard_ms / gram_ms,
                zb::newton_schulz_multiply_adds(rows, cols, steps) /
                    zb::gram_newton_schulz_multiply_adds(rows, cols, steps, coefficients.gram_restarts),
                zb::gram_newton_schulz_pays(rows, cols, steps, coefficients) ? "yes" : "no", standard_error,
                gram_error);
  }
  return 0;
}
