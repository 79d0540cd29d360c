// What only a GPU can check: the model in bf16 on CUDA against fp32 on the CPU, flash attention
// chosen for the presets' attention shapes, NCCL collectives in a world of one process, and
// pinned-memory batches reaching the GPU intact. Every test skips where CUDA has no device
// (zb::cuda_available()); scripts/gpu/gpu_check.sh runs them on a lent GPU (ctest -L cuda).
#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "data/documents.h"
#include "data/fake_data.h"
#include "data/loader.h"
#include "model/attention.h"
#include "model/chunked_loss.h"
#include "model_parallel/context_parallel.h"
#include "float8/float8.h"
#include "kernels/fp32_updates.h"
#include "kernels/gemm_add.h"
#include "model/layers.h"
#include "model/llama.h"
#include "model/model_args.h"
#include "model/moe.h"
#include "util/device.h"

#ifdef ZB_WITH_CUDA
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "dist/comm.h"
#include "dist/world.h"
#include "kernels/cuda_ops.h"
#endif

using namespace zb;

#define SKIP_WITHOUT_GPU()                                                                  \
  if (!cuda_available())                                                                    \
  GTEST_SKIP() << "no CUDA device here (zb::cuda_available() is false); scripts/gpu/gpu_check.sh " \
                  "runs this on a GPU"

namespace {

const c10::Device kGpu(c10::kCUDA, 0);

// ||a - b|| / ||b||, in float64 on the CPU.
double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.detach().cpu().to(at::kDouble), y = b.detach().cpu().to(at::kDouble);
  return (x - y).norm().item<double>() / y.norm().item<double>();
}

const char* sdp_backend_name(int64_t b) {
  switch (static_cast<at::SDPBackend>(b)) {
    case at::SDPBackend::error: return "error (none fits)";
    case at::SDPBackend::math: return "math (unfused)";
    case at::SDPBackend::flash_attention: return "flash_attention";
    case at::SDPBackend::efficient_attention: return "efficient_attention";
    case at::SDPBackend::cudnn_attention: return "cudnn_attention";
    case at::SDPBackend::overrideable: return "overrideable";
  }
  return "?";
}

}  // namespace

// The same fp32 master weights on both devices; the GPU computes in bf16 as training does
// (runtime.compute_dtype auto), the CPU in fp32: the loss and every gradient compared, then
// `more` looks at the GPU's model.
void expect_bf16_gpu_matches_fp32_cpu(const ModelArgs& a, const std::function<void(const Llama& gpu)>& more = {}) {
  at::manual_seed(0);
  Llama cpu(a, at::TensorOptions());
  cpu.init_weights();
  Llama gpu(a, at::TensorOptions().device(kGpu));
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < cpu.parameters().size(); ++i) gpu.parameters()[i].slot->copy_(*cpu.parameters()[i].slot);
  }
  gpu.set_compute_dtype(at::kBFloat16);
  const at::Tensor tokens = at::randint(3, a.vocab_size, {4, 256}, at::kLong);
  const at::Tensor targets = at::randint(3, a.vocab_size, {4, 256}, at::kLong);
  at::Tensor ref = cross_entropy(cpu.forward(tokens), targets);
  ref.backward();
  at::Tensor got = gpu.loss(tokens.to(kGpu), targets.to(kGpu));  // training's path: chunked head and loss
  got.backward();

  // Tolerances. bf16 keeps 8 significant bits (a rounding is off by up to 2^-9 = 0.2%), and
  // matmuls and attention accumulate in fp32, so the error comes from rounding each op's inputs
  // and outputs. The loss, a mean over 1,024 tokens, averages it out; a gradient, the product of
  // the whole backward chain, does not. The same comparison with bf16 on a CPU (this model,
  // seed and batch, measured once): loss 3e-5 relative, gradients ||g_bf16 - g_fp32|| / ||g_fp32||
  // from 0.4% (norm.weight) to 1.1% (layers.3.attention.wk.weight). Allowed: 2e-3 on the loss and
  // 5e-2 per gradient, room for the GPU's other kernels (flash's backward, cuBLAS's bf16
  // epilogues); a wrong kernel, a lost cast back to fp32 or a bad layout is off by order 1.
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  const double loss_error = std::abs(got.item<double>() - ref.item<double>()) / ref.item<double>();
  std::cout << "loss: fp32 CPU " << ref.item<double>() << ", bf16 GPU " << got.item<double>()
            << ", relative difference " << loss_error << "\n";
  EXPECT_LT(loss_error, 2e-3);
  double worst = 0;
  std::string worst_name;
  for (size_t i = 0; i < cpu.parameters().size(); ++i) {
    const auto& name = cpu.parameters()[i].name;
    const at::Tensor& g = gpu.parameters()[i].slot->grad();
    const at::Tensor& ref_g = cpu.parameters()[i].slot->grad();
    ASSERT_TRUE(g.defined()) << name;
    EXPECT_EQ(g.scalar_type(), at::kFloat) << name << ": master gradients stay fp32";
    EXPECT_TRUE(g.is_cuda()) << name;
    const double e = relative_error(g, ref_g);
    EXPECT_LT(e, 5e-2) << name << ": gradient norm bf16 GPU " << g.norm().item<double>() << ", fp32 CPU "
                       << ref_g.norm().item<double>();
    if (e > worst) worst = e, worst_name = name;
  }
  std::cout << "largest relative gradient error " << worst << " (" << worst_name << ")\n";
  if (more) more(gpu);
}

TEST(CudaModel, Bf16ForwardBackwardMatchesFp32OnCpu) {
  SKIP_WITHOUT_GPU();
  // head_dim 64 as in the 150M preset, so the GPU's attention is the flash kernel training uses.
  ModelArgs a = lookup_model_args("llama2", "debugmodel");
  a.dim = 512, a.n_layers = 4, a.n_heads = 8, a.n_kv_heads = 8, a.vocab_size = 2048, a.max_seq_len = 256;
  expect_bf16_gpu_matches_fp32_cpu(a);
}

TEST(CudaAttention, ChosenKernelForThePresetsShapes) {
  SKIP_WITHOUT_GPU();
  // The query/key/value layout attention hands to scaled_dot_product_attention
  // (src/model/layers.cpp): [B, T, H, Dh] transposed to [B, H, T, Dh], bf16, causal, requiring
  // gradients as in training. _fused_sdp_choice is the dispatcher's own choice for these inputs.
  // runtime.sdpa_backend = "flash" must give flash; "auto" (PyTorch's preference: cuDNN's
  // attention on an H100 with torch 2.11, reportedly) must give a fused kernel, printed, and the
  // metrics' attention_kernel must name the same one.
  struct Shape { const char* name; int64_t heads, head_dim; };
  const Shape shapes[] = {{"debugmodel", 8, 32}, {"150M", 16, 64}, {"1B", 16, 128}, {"7B", 32, 128}};
  const auto props = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  for (const std::string backend : {"auto", "flash"}) {
    use_sdpa_backend(backend);
    for (const auto& s : shapes) {
      const int64_t T = 1024;
      const at::Tensor q = at::randn({2, T, s.heads, s.head_dim}, props).requires_grad_(true);
      const int64_t choice = at::_fused_sdp_choice(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2),
                                                   /*attn_mask=*/{}, 0.0, /*is_causal=*/true, std::nullopt, false);
      const std::string reported = attention_kernel(kGpu, at::kBFloat16, T, s.heads, s.heads, s.head_dim, false, false);
      std::cout << "sdpa_backend " << backend << ", " << s.name << ": " << sdp_backend_name(choice) << "\n";
      EXPECT_EQ(reported, sdp_backend_name(choice)) << s.name;
      if (backend == "flash")
        EXPECT_EQ(choice, static_cast<int64_t>(at::SDPBackend::flash_attention)) << s.name;
      else
        EXPECT_TRUE(choice == static_cast<int64_t>(at::SDPBackend::flash_attention) ||
                    choice == static_cast<int64_t>(at::SDPBackend::cudnn_attention))
            << s.name << ": scaled_dot_product_attention would run " << sdp_backend_name(choice);
    }
  }
  use_sdpa_backend("auto");
}

TEST(CudaAttention, FlashAndTheChosenKernelComputeAttention) {
  SKIP_WITHOUT_GPU();
  struct Shape { const char* name; int64_t heads, head_dim; };
  const Shape shapes[] = {{"debugmodel", 8, 32}, {"150M", 16, 64}, {"1B", 16, 128}, {"7B", 32, 128}};
  const auto props = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  for (const std::string backend : {"auto", "flash"})
  for (const auto& s : shapes) {
    use_sdpa_backend(backend);
    const int64_t B = 2, T = 1024;
    at::Tensor q = at::randn({B, T, s.heads, s.head_dim}, props).requires_grad_(true);
    at::Tensor k = at::randn({B, T, s.heads, s.head_dim}, props).requires_grad_(true);
    at::Tensor v = at::randn({B, T, s.heads, s.head_dim}, props).requires_grad_(true);

    // And the kernel computes attention: attention() against softmax(q k^T / sqrt(Dh)) v
    // in fp32 on the same (bf16-rounded) inputs. Flash and cuDNN accumulate in fp32 and round
    // the output to bf16: half an ulp, 2^-9 relative, and one ulp (2^-8) where their fp32 sums
    // land on the other side of a rounding boundary. They also round the probabilities to bf16
    // before multiplying by v: 2^-9 of a convex combination of values of size ~1, 2^-8 absolute
    // with room. A fixed absolute bound is wrong here: the first rows attend to one position,
    // their outputs are v itself, up to ~5 at these sizes (an ulp of 2^-5); the 7B shape with
    // cuDNN on an H200 (2026-11-26) missed 1e-2 absolute by 0.013.
    at::NoGradGuard no_grad;
    const at::Tensor out = attention(q, k, v).to(at::kFloat);  // [B, T, H*Dh]
    const at::Tensor qf = q.transpose(1, 2).to(at::kFloat), kf = k.transpose(1, 2).to(at::kFloat),
                     vf = v.transpose(1, 2).to(at::kFloat);
    const at::Tensor mask = at::ones({T, T}, at::TensorOptions().device(kGpu).dtype(at::kBool)).triu(1);
    const at::Tensor scores = at::matmul(qf, kf.transpose(-2, -1)) / std::sqrt(static_cast<double>(s.head_dim));
    const at::Tensor ref = at::matmul(at::softmax(scores.masked_fill(mask, -INFINITY), -1), vf)
                               .transpose(1, 2)
                               .reshape({B, T, s.heads * s.head_dim});
    const at::Tensor excess = (out - ref).abs() - ref.abs() * std::ldexp(1.0, -8);
    const int64_t worst = excess.flatten().argmax().item<int64_t>();
    std::cout << s.name << ", sdpa_backend " << backend << ": max |out - ref| "
              << (out - ref).abs().max().item<double>() << ", worst excess over 2^-8 |ref| "
              << excess.flatten()[worst].item<double>() << "\n";
    EXPECT_LT(excess.flatten()[worst].item<double>(), std::ldexp(1.0, -8))
        << s.name << " with sdpa_backend " << backend << ": output " << out.flatten()[worst].item<double>()
        << " against " << ref.flatten()[worst].item<double>();
  }
  use_sdpa_backend("auto");
}

TEST(CudaClock, EventsAreReadAfterTheHostWaited) {
  SKIP_WITHOUT_GPU();
  // The step's timing on real events: a mark behind queued work may not be read before
  // synchronize() (our error, not CUDA's cudaErrorNotReady), and afterwards the interval holds
  // the work (a chain of large products: milliseconds at least).
  StepClock clock(kGpu);
  const at::Tensor a = at::randn({4096, 4096}, at::TensorOptions().device(kGpu));
  const int start = clock.mark();
  at::Tensor x = a;
  for (int i = 0; i < 20; ++i) x = at::mm(x, a) / 64.0;
  const int end = clock.mark();
  EXPECT_THROW(clock.seconds(start, end), std::logic_error);
  clock.synchronize();
  const double seconds = clock.seconds(start, end);
  std::cout << "20 fp32 products 4096^3 on the GPU: " << seconds << " s\n";
  EXPECT_GT(seconds, 1e-3);
}

TEST(CudaMemory, BudgetIsMeasuredOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const DeviceMemory m = device_memory(kGpu);
  std::cout << "device memory: " << m.available / double(1 << 30) << " GiB available of " << m.total / double(1 << 30)
            << " GiB\n";
  EXPECT_GT(m.total, int64_t{8} << 30);
  EXPECT_GT(m.available, 0);
  EXPECT_LE(m.available, m.total);
  // What this process's allocator keeps cached counts as available: a freed 1 GiB block stays.
  { at::Tensor block = at::empty({int64_t{1} << 28}, at::TensorOptions().device(kGpu)); }
  const DeviceMemory after = device_memory(kGpu);
  EXPECT_NEAR(static_cast<double>(after.available), static_cast<double>(m.available), 64.0 * (1 << 20));
}

TEST(CudaLoss, Fp32ProductsOfBf16MatchFloat64) {
  SKIP_WITHOUT_GPU();
  // The chunked loss on the GPU in bf16, its GEMMs writing and accumulating fp32 (mm/addmm with an
  // output dtype), against the same bf16-rounded inputs in float64 on the CPU: loss, dx, dw.
  // Several chunks (chunk_tokens 300 of 1,000 tokens); a 32k vocabulary.
  const int64_t N = 1000, D = 256, V = 32000;
  at::manual_seed(7);
  const at::Tensor x0 = at::randn({N, D}).to(at::kBFloat16), w0 = (at::randn({V, D}) * 0.05).to(at::kBFloat16);
  const at::Tensor targets = at::randint(V, {N}, at::kLong);
  auto run = [&](const c10::Device& device, at::ScalarType dtype) {
    at::Tensor x = x0.to(device, dtype).requires_grad_(true), w = w0.to(device, dtype).requires_grad_(true);
    at::Tensor loss = chunked_cross_entropy(x, w, targets.to(device), /*chunk_tokens=*/300);
    loss.backward();
    return std::vector<at::Tensor>{loss.detach(), x.grad(), w.grad()};
  };
  const auto gpu = run(kGpu, at::kBFloat16);
  const auto ref = run(at::kCPU, at::kDouble);
  EXPECT_EQ(gpu[0].scalar_type(), at::kFloat);
  EXPECT_LT(relative_error(gpu[0], ref[0]), 1e-4) << "loss";
  // Gradients come back in bf16 (2^-9 relative rounding of each element).
  EXPECT_LT(relative_error(gpu[1], ref[1]), 1e-2) << "dx";
  EXPECT_LT(relative_error(gpu[2], ref[2]), 1e-2) << "dw";
}

TEST(CudaLoss, FusedLogitGradientEqualsAtensOperators) {
  SKIP_WITHOUT_GPU();
  // The chunked loss on the GPU in bf16 with our kernels for each row's log-sum-exp and for
  // softmax(z) - onehot (kernels/loss_grad_kernel.cu) against the same loss with ATen's operators
  // alone (KernelChoices with none fused): the same fp32 arithmetic but for the order of the log-sum-exp's
  // sums, rounded once to bf16, so the loss equal to fp32 rounding, and dx and dw each element
  // within one bf16 step, nearly all bit-identical. Then the kernel itself on an odd width
  // (its single-value path), z off alignment, and a vocabulary split at 1,000 (targets outside
  // the slice get no one-hot).
  const int64_t N = 1000, D = 256, V = 32000;
  at::manual_seed(9);
  const auto bf16 = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  const at::Tensor x0 = at::randn({N, D}, bf16), w0 = at::randn({V, D}, bf16) * 0.05;
  const at::Tensor targets = at::randint(V, {N}, at::TensorOptions().device(kGpu).dtype(at::kLong));
  auto run = [&](bool fused) {
    const KernelChoices kernels = KernelChoices::from(fused, "", "flash");
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor loss = chunked_cross_entropy(x, w, targets, /*chunk_tokens=*/300, nullptr, 0, kernels);
    loss.backward();
    return std::vector<at::Tensor>{loss.detach(), x.grad(), w.grad()};
  };
#ifdef ZB_WITH_CUDA
  // The fused run under the profiler: our kernel is among the GPU kernels it launched (else the
  // comparison below would be ATen's operators against themselves).
  namespace prof = torch::autograd::profiler;
  namespace impl = torch::profiler::impl;
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU, impl::ActivityType::CUDA};
  const impl::ProfilerConfig cfg(impl::ProfilerState::KINETO, false, false);
  prof::prepareProfiler(cfg, activities);
  prof::enableProfiler(cfg, activities);
  const auto got = run(true);
  (void)got[2].sum().item<double>();  // the GPU has run it
  const std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  int64_t ours = 0, lse = 0;
  for (const prof::KinetoEvent& e : result->events()) {
    if (e.name().find("softmax_grad_bf16") != std::string::npos) ++ours;
    if (e.name().find("row_logsumexp_fp32") != std::string::npos) ++lse;
  }
  EXPECT_EQ(ours, 4) << "launches of our logit-gradient kernel: one per chunk of 300 of 1,000 tokens";
  EXPECT_EQ(lse, 4) << "launches of our log-sum-exp kernel: one per chunk";
#else
  const auto got = run(true);
#endif
  const auto want = run(false);
  auto compare = [](const std::string& name, const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor af = a.detach().to(at::kFloat), bf = b.detach().to(at::kFloat);
    const at::Tensor off = (af - bf).abs() > bf.abs() * std::ldexp(1.0, -7) + std::ldexp(1.0, -14);
    EXPECT_EQ(off.sum().item<int64_t>(), 0) << name << ": elements more than one bf16 step apart";
    const double same = af.eq(bf).to(at::kDouble).mean().item<double>();
    std::cout << "logit gradient, " << name << ": " << same * 100 << "% bit-identical\n";
    EXPECT_GT(same, 0.99) << name;
  };
  // The same logits; the fused run's log-sum-exp sums each row in another order (within 4 fp32
  // steps of ~7, 3e-6, a row; the mean of 1,000 rows' errors much less).
  EXPECT_NEAR(got[0].item<double>(), want[0].item<double>(), 1e-5) << "loss";
  compare("dx", got[1], want[1]);
  compare("dw", got[2], want[2]);
#ifdef ZB_WITH_CUDA
  const auto f32 = at::TensorOptions().device(kGpu).dtype(at::kFloat);
  for (const auto& [rows, width, offset, vocab_start] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{37, 1001, 0, 0}, {64, 4000, 1, 0}, {50, 1000, 0, 1000}}) {
    const at::Tensor z = (at::randn({rows * width + offset}, f32) * 3).narrow(0, offset, rows * width).view({rows, width});
    const at::Tensor lse = at::logsumexp(z, {1}, true);
    const at::Tensor t = at::randint(3 * width, {rows}, targets.options());
    ASSERT_TRUE(softmax_grad_cuda_bf16_applies(z, lse, t));
    const at::Tensor g = softmax_grad_cuda_bf16(z, lse, t, vocab_start);
    at::Tensor ref = z.clone();
    ref.sub_(lse).exp_();
    const at::Tensor local = t.unsqueeze(1) - vocab_start, here = local.ge(0).logical_and(local.lt(width));
    ref.scatter_add_(1, local.clamp(0, width - 1), at::where(here, at::full_like(local, -1, ref.options()),
                                                              at::zeros({1}, ref.options())));
    compare("kernel " + std::to_string(rows) + " x " + std::to_string(width) + ", offset " + std::to_string(offset) +
                ", vocab_start " + std::to_string(vocab_start),
            g, ref.to(at::kBFloat16));
  }
#endif
}

TEST(CudaLoss, RowLogSumExpEqualsAtensWithinFp32Rounding) {
  SKIP_WITHOUT_GPU();
  // Our one-pass log-sum-exp of each row (the chunked loss's, kernels/loss_grad_kernel.cu) against
  // ATen's in float64 on the same fp32 values: the 1B and 8B presets' vocabularies (32,000 and
  // 128,256), an odd width, z off 16-byte alignment, values spread over 60, a row of -inf, one
  // with a NaN in its last column and one with a +inf.
  // Within 4 fp32 steps of the result's magnitude, as on the host (KernelsOnHost).
  const auto f32 = at::TensorOptions().device(kGpu).dtype(at::kFloat);
  at::manual_seed(10);
  for (const auto& [rows, width, offset] :
       {std::tuple<int64_t, int64_t, int64_t>{300, 32000, 0}, {37, 1001, 0}, {64, 4000, 1}, {9, 128256, 0}}) {
    at::Tensor z = (at::randn({rows * width + offset}, f32) * 20).narrow(0, offset, rows * width).view({rows, width});
    z[3].fill_(-INFINITY);
    z[5][width - 1] = NAN;       // a diverged logit: the row's result NaN
    z[7][width / 2] = INFINITY;  // +inf: the row's result +inf
    ASSERT_TRUE(row_logsumexp_cuda_applies(z));
    const at::Tensor got = row_logsumexp_cuda(z).squeeze(1).to(at::kDouble).cpu();
    const at::Tensor want = at::logsumexp(z.to(at::kDouble), {1}).cpu();
    const at::Tensor finite = want.isfinite();
    const at::Tensor off = ((got - want).abs() > want.abs() * 4 * std::ldexp(1.0, -23) + 1e-6).logical_and(finite);
    EXPECT_EQ(off.sum().item<int64_t>(), 0) << rows << " x " << width << ", offset " << offset;
    EXPECT_TRUE(got[3].item<double>() == -INFINITY) << "the row of -inf";
    EXPECT_TRUE(std::isnan(got[5].item<double>())) << "the row with a NaN";
    EXPECT_TRUE(got[7].item<double>() == INFINITY) << "the row with a +inf";
  }
}

TEST(CudaRmsNorm, ResidualNodesKernelMatchesFloat64) {
  SKIP_WITHOUT_GPU();
  // A norm whose input goes on in the residual stream, as a block uses it (h2 = h' + o, y =
  // rms_norm(h)), on the GPU in bf16: the node's backward is our kernel, one launch, adding the
  // residual's gradient in the same pass (kernels/rms_norm_kernel.cu). Against its formula in float64
  // on the same bf16 values: dh within one bf16 step of its size (rounded once), the weight's
  // gradient (fp32 partial sums, then bf16 as ATen's) within 2^-8 of its size plus 1e-4 of the
  // largest; y bit-identical to rms_norm's (the same ATen kernel). Shapes: a 1B micro-batch's
  // rows of 2,048, the 7B's 4,096, and a width of 8.
  namespace prof = torch::autograd::profiler;
  namespace impl = torch::profiler::impl;
  at::manual_seed(13);
  const auto bf16 = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{4, 1024, 2048}, {2, 77, 4096}, {3, 5, 8}}) {
    const int64_t D = shape.back();
    const at::Tensor h0 = at::randn(shape, bf16) * 3, o = at::randn(shape, bf16);
    const at::Tensor c1 = at::randn(shape, bf16), c2 = at::randn(shape, bf16);
    const at::Tensor w0 = at::rand({D}, at::TensorOptions().device(kGpu)) + 0.5;  // the fp32 master
    at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const std::set<impl::ActivityType> activities{impl::ActivityType::CPU, impl::ActivityType::CUDA};
    const impl::ProfilerConfig cfg(impl::ProfilerState::KINETO, false, false);
    prof::prepareProfiler(cfg, activities);
    prof::enableProfiler(cfg, activities);
    auto [h_on, y] = rms_norm_residual(h, w, 1e-5);
    ((c2 * y).sum() + (c1 * (h_on + o)).sum()).backward();
    (void)h.grad().sum().item<double>();
    const std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
    int64_t ours = 0;
    for (const prof::KinetoEvent& e : result->events())
      if (e.name().find("rms_norm_backward_bf16") != std::string::npos) ++ours;
    EXPECT_EQ(ours, 1) << D << ": launches of our norm backward";
    EXPECT_TRUE(at::equal(y, rms_norm(h0, w0, 1e-5))) << D << ": the forward is rms_norm's";

    const at::Tensor hd = h0.to(at::kDouble), r = (hd.pow(2).mean(-1, true) + 1e-5).rsqrt(), x_hat = hd * r;
    const at::Tensor dy = c2.to(at::kDouble), wg = dy * w0.to(at::kBFloat16).to(at::kDouble);
    const at::Tensor dh_want = r * (wg - x_hat * (wg * x_hat).mean(-1, true)) + c1.to(at::kDouble);
    const at::Tensor dh = h.grad().to(at::kDouble);
    const at::Tensor far = (dh - dh_want).abs() > dh_want.abs() * std::ldexp(1.0, -7) + 1e-3;
    EXPECT_EQ(far.sum().item<int64_t>(), 0) << D << ": dh more than one bf16 step off, worst "
                                            << (dh - dh_want).abs().max().item<double>();
    const at::Tensor dw_want = (dy * x_hat).reshape({-1, D}).sum(0), dw = w.grad().to(at::kDouble);
    const at::Tensor dw_far = (dw - dw_want).abs() > dw_want.abs() * std::ldexp(1.0, -8) +
                                                         1e-4 * dw_want.abs().max().item<double>();
    EXPECT_EQ(dw_far.sum().item<int64_t>(), 0) << D << ": dweight, worst " << (dw - dw_want).abs().max().item<double>();
  }
}

TEST(CudaLinears, SharedInputsGradientSummedInsideTheGemms) {
  SKIP_WITHOUT_GPU();
  // q, k, v of a GQA block from one input through one node (shared_input_linears) on the GPU in
  // bf16: x's gradient is summed by the GEMMs themselves (addmm with beta 1). Against float64 on the
  // same bf16 values. A bf16 rounding moves a value by at most 2^-8 of its size; the node rounds
  // three partial sums and autograd's separate products and adds round five values, and in both
  // the sizes rounded add up to at most three times the sum of the three products' sizes
  // (dx_size): so each element of dx within 3 * 2^-8 * dx_size (plus 1e-3 for the GEMMs' fp32
  // sums), for the node and for autograd's own linears (fused kernels off), the path it replaces.
  // The weights' gradients: one bf16 step plus 1e-3 of the largest. (2^-7 * dx_size, two
  // roundings' worth, failed both paths on an H100.)
  at::manual_seed(15);
  const auto bf16 = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  const at::Tensor x0 = at::randn({4, 512, 1024}, bf16);
  const std::vector<at::Tensor> w0{at::randn({1024, 1024}, bf16) * 0.03, at::randn({256, 1024}, bf16) * 0.03,
                                   at::randn({256, 1024}, bf16) * 0.03};
  std::vector<at::Tensor> c;
  for (const at::Tensor& w : w0) c.push_back(at::randn({4, 512, w.size(0)}, bf16));
  const at::Tensor x64 = x0.to(at::kDouble).reshape({-1, 1024});
  at::Tensor dx_want = at::zeros_like(x64), dx_size = at::zeros_like(x64);
  std::vector<at::Tensor> dw_want;
  for (size_t i = 0; i < 3; ++i) {
    const at::Tensor g = c[i].to(at::kDouble).reshape({-1, w0[i].size(0)});
    const at::Tensor part = at::mm(g, w0[i].to(at::kDouble));
    dx_want += part;
    dx_size += part.abs();
    dw_want.push_back(at::mm(g.t(), x64));
  }
  for (const bool fused : {true, false}) {
    at::Tensor x = x0.clone().requires_grad_(true);
    std::vector<at::Tensor> w;
    for (const at::Tensor& wi : w0) w.push_back(wi.clone().requires_grad_(true));
    const std::vector<at::Tensor> y = shared_input_linears(x, w, KernelChoices::from(fused, "", "flash"));
    at::Tensor loss = at::zeros({}, at::TensorOptions().device(kGpu));
    for (size_t i = 0; i < 3; ++i) loss = loss + (y[i] * c[i]).sum();
    loss.backward();
    const std::string what = fused ? "the node" : "autograd's linears";
    EXPECT_EQ((y[0].grad_fn() == y[1].grad_fn()), fused) << what << ": one node for the three, or three";
    const at::Tensor dx = x.grad().to(at::kDouble).reshape({-1, 1024});
    EXPECT_EQ(((dx - dx_want).abs() > dx_size * 3 * std::ldexp(1.0, -8) + 1e-3).sum().item<int64_t>(), 0)
        << what << ": dx, worst " << (dx - dx_want).abs().max().item<double>();
    for (size_t i = 0; i < 3; ++i) {
      const at::Tensor dw = w[i].grad().to(at::kDouble);
      EXPECT_EQ(((dw - dw_want[i]).abs() > dw_want[i].abs() * std::ldexp(1.0, -7) +
                                              1e-3 * dw_want[i].abs().max().item<double>())
                    .sum()
                    .item<int64_t>(),
                0)
          << what << ": dw " << i;
    }
  }
}

TEST(CudaRope, FusedKernelEqualsTheUnfusedPathWithinOneBf16Rounding) {
  SKIP_WITHOUT_GPU();
  // bf16 q-shaped tensors [B, T, H, Dh] (odd sizes too), rotated by the fused kernel (apply_rope on
  // CUDA) and by ATen's fp32 path, forward and backward (and backward's backward): the same fp32
  // products rounded to bf16, so each element within one bf16 step (2^-7 of its magnitude) where
  // fused multiply-adds round differently, and nearly all of them bit-identical.
  const int64_t Dh = 64;
  const RopeTables rope = rope_tables(Dh, 2 * 512, 10000.0, at::TensorOptions().device(kGpu));
  at::manual_seed(3);
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{2, 512, 8, Dh}, std::vector<int64_t>{3, 77, 5, Dh}}) {
    const at::Tensor x0 = at::randn(shape, at::TensorOptions().device(kGpu).dtype(at::kBFloat16));
    const at::Tensor g = at::randn(shape, x0.options());
    at::Tensor xf = x0.clone().requires_grad_(true), xu = x0.clone().requires_grad_(true);
    const at::Tensor fused = apply_rope(xf, rope), unfused = apply_rope_unfused(xu, rope);
#ifdef ZB_WITH_CUDA
    ASSERT_NE(fused.grad_fn()->name().find("RopeBf16"), std::string::npos) << fused.grad_fn()->name();
#endif
    fused.backward(g);
    unfused.backward(g);
    // Backward's own backward: the gradient g rotated back is R^T g, whose derivative in g along g
    // is R g, the forward rotation of g.
    at::Tensor x2 = x0.clone().requires_grad_(true), g2 = g.clone().requires_grad_(true);
    const at::Tensor back = torch::autograd::grad({apply_rope(x2, rope)}, {x2}, {g2}, true, true)[0];
    const at::Tensor twice = torch::autograd::grad({back}, {g2}, {g})[0];
    const at::Tensor rotated = apply_rope_unfused(g, rope);
    for (const auto& [name, a, b] : {std::tuple{"forward", fused, unfused}, std::tuple{"backward", xf.grad(), xu.grad()},
                                     std::tuple{"second derivative", twice, rotated}}) {
      EXPECT_EQ(a.scalar_type(), at::kBFloat16) << name;
      const at::Tensor af = a.detach().to(at::kFloat), bf = b.detach().to(at::kFloat);
      // (2^-14 absolute where the two products nearly cancel: there fused multiply-adds may differ
      // by 2^-24 of the products, many bf16 steps of a tiny result.)
      const at::Tensor off = (af - bf).abs() > bf.abs() * std::ldexp(1.0, -7) + std::ldexp(1.0, -14);
      EXPECT_EQ(off.sum().item<int64_t>(), 0) << name << ": elements more than one bf16 step apart";
      const double same = af.eq(bf).to(at::kDouble).mean().item<double>();
      std::cout << "RoPE " << name << " " << at::IntArrayRef(shape) << ": " << same * 100 << "% bit-identical\n";
      EXPECT_GT(same, 0.99) << name;
    }
  }
}

TEST(CudaMlp, FusedGateEqualsAtensSiluThenMul) {
  SKIP_WITHOUT_GPU();
  // SwiGLU's gate on bf16 (silu_mul: kernels/silu_mul_kernel.cu) against ATen's silu then mul on the
  // same GPU, differentiated by autograd: the same fp32 arithmetic rounded to bf16 at the same
  // places, so each element within one bf16 step (2^-7 of its magnitude) where fused multiply-adds
  // or exp round differently, and nearly all bit-identical. Shapes: the 1B preset's hidden layer
  // (5632) for a few tokens, an odd one (the kernel's single-value tail), and a tensor whose data
  // starts 2 bytes past 16-byte alignment (its single-value path throughout).
  at::manual_seed(4);
  const auto bf16 = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  const at::Tensor misaligned = (at::randn({3 * 77 * 37 + 1}, bf16) * 4).narrow(0, 1, 3 * 77 * 37).view({3, 77, 37});
  for (const at::Tensor& a0 : {at::randn({2, 64, 5632}, bf16) * 4, at::randn({3, 77, 37}, bf16) * 4, misaligned}) {
    const at::Tensor b0 = at::randn(a0.sizes(), bf16), g = at::randn(a0.sizes(), bf16);
    at::Tensor a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    at::Tensor ra = a0.clone().requires_grad_(true), rb = b0.clone().requires_grad_(true);
    const at::Tensor got = silu_mul(a, b), want = at::silu(ra) * rb;
    got.backward(g);
    want.backward(g);
    std::vector<std::tuple<std::string, at::Tensor, at::Tensor>> pairs = {
        {"forward", got, want}, {"gradient of a", a.grad(), ra.grad()}, {"gradient of b", b.grad(), rb.grad()}};
#ifdef ZB_WITH_CUDA
    // The kernels themselves on the inputs as given (the misaligned one included: silu_mul saw
    // aligned clones).
    ASSERT_TRUE(silu_mul_cuda_bf16_applies(a0, b0));
    const auto [ga, gb] = silu_mul_backward_cuda_bf16(g, a0, b0);
    pairs.push_back({"kernel forward", silu_mul_cuda_bf16(a0, b0), want});
    pairs.push_back({"kernel gradient of a", ga, ra.grad()});
    pairs.push_back({"kernel gradient of b", gb, rb.grad()});
    ASSERT_NE(got.grad_fn()->name().find("SiluMul"), std::string::npos) << got.grad_fn()->name();
#endif
    for (const auto& [name, x, y] : pairs) {
      EXPECT_EQ(x.scalar_type(), at::kBFloat16) << name;
      const at::Tensor xf = x.detach().to(at::kFloat), yf = y.detach().to(at::kFloat);
      const at::Tensor off = (xf - yf).abs() > yf.abs() * std::ldexp(1.0, -7) + std::ldexp(1.0, -14);
      EXPECT_EQ(off.sum().item<int64_t>(), 0) << name << ": elements more than one bf16 step apart";
      const double same = xf.eq(yf).to(at::kDouble).mean().item<double>();
      std::cout << "silu_mul " << name << " " << a0.sizes() << ": " << same * 100 << "% bit-identical\n";
      EXPECT_GT(same, 0.99) << name;
    }
  }
}

namespace {
// Document attention by a variable-length kernel on the GPU (runtime.varlen_kernel `kernel`; bf16,
// the rows flattened) against the additive-mask path on the CPU in fp32 on the same bf16-rounded
// inputs: outputs and the gradients of q, k, v for a fixed output gradient. Rows: many
// documents, one, and GQA heads.
void varlen_kernel_equals_the_cpu_mask(const std::string& kernel) {
  const int64_t B = 3, T = 256, H = 8, Dh = 64;
  for (int64_t Hkv : {H, int64_t{2}}) {
    at::manual_seed(5);
    at::Tensor tokens = at::randint(3, 50, {B, T}, at::kLong);
    tokens[0].index_put_({at::arange(10, T, 37)}, 1);  // documents of 37 tokens
    tokens[2].index_put_({at::tensor(std::vector<int64_t>{0, 1, 2, 200, T - 1}, at::kLong)}, 1);  // short ones, an EOS at both ends
    std::vector<int32_t> cu{0};
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b)
      append_document_bounds(tokens[b].contiguous().data_ptr<int64_t>(), T, {1, false}, cu, max_len);
    const at::Tensor cu_seqlens = at::tensor(cu, at::kInt);
    ASSERT_TRUE(varlen_flash_supported(kGpu, at::kBFloat16, Dh));
    const Documents on_gpu =
        make_documents(cu_seqlens, max_len, T, kGpu, at::kBFloat16, true, /*cudnn_varlen=*/kernel == "cudnn");
    const Documents on_cpu = make_documents(cu_seqlens, max_len, T, at::kCPU, at::kFloat, false);
    ASSERT_TRUE(on_gpu.cu_seqlens.defined() && !on_gpu.mask.defined());
    auto make = [](at::IntArrayRef shape) { return at::randn(shape, at::kFloat).to(at::kBFloat16); };
    const at::Tensor q0 = make({B, T, H, Dh}), k0 = make({B, T, Hkv, Dh}), v0 = make({B, T, Hkv, Dh});
    const at::Tensor dout = at::randn({B, T, H * Dh}, at::kFloat);
    auto run = [&](const c10::Device& device, at::ScalarType dtype, const Documents& documents) {
      at::Tensor q = q0.to(device, dtype).requires_grad_(true), k = k0.to(device, dtype).requires_grad_(true),
                 v = v0.to(device, dtype).requires_grad_(true);
      at::Tensor out = attention(q, k, v, documents);
      out.backward(dout.to(device, dtype));
      return std::vector<at::Tensor>{out, q.grad(), k.grad(), v.grad()};
    };
    const auto gpu = run(kGpu, at::kBFloat16, on_gpu);
    const auto cpu = run(at::kCPU, at::kFloat, on_cpu);
    const char* names[] = {"output", "dq", "dk", "dv"};
    // bf16 outputs and gradients (2^-9 relative rounding, fp32 accumulation in the kernel).
    for (int i = 0; i < 4; ++i)
      EXPECT_LT(relative_error(gpu[i], cpu[i]), 2e-2) << kernel << ": " << names[i] << " Hkv " << Hkv;
  }
}
}  // namespace

TEST(CudaAttention, VarlenFlashEqualsTheCpuMask) {
  SKIP_WITHOUT_GPU();
  varlen_kernel_equals_the_cpu_mask("flash");
}

TEST(CudaAttention, CudnnVarlenEqualsTheCpuMask) {
  SKIP_WITHOUT_GPU();
  // cuDNN's forward over the same cumulative lengths, flash's backward from its output and
  // log-sum-exp (runtime.varlen_kernel = "cudnn"). cuDNN's own varlen backward in torch 2.11 failed
  // this test on an H100 (dq off by 78%: it sizes its work by head_dim, pytorch/pytorch#186142).
  varlen_kernel_equals_the_cpu_mask("cudnn");
}

TEST(CudaNccl, CollectivesInAWorldOfOne) {
  SKIP_WITHOUT_GPU();
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "built against a LibTorch without CUDA: no NCCL backend";
#else
  // A single process makes no backend in Communicator (its collectives are local copies), so
  // the NCCL backend is made here as Communicator makes it for a distributed run (same function:
  // the nccl.h/libnccl version check, bound device, eager communicator), over an in-memory store.
  World world;  // rank 0 of 1
  auto store = c10::make_intrusive<c10d::HashStore>();
  c10::intrusive_ptr<c10d::Backend> nccl = make_nccl_backend(store, world, kGpu, std::chrono::seconds(60));
  ASSERT_TRUE(nccl);
  EXPECT_EQ(nccl->getSize(), 1);

  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto opts = at::TensorOptions().device(kGpu).dtype(dtype);
    const at::Tensor expected = at::arange(1000, opts) / 7;
    // all-reduce (sum over one rank: unchanged), in place.
    std::vector<at::Tensor> t{expected.clone()};
    c10d::AllreduceOptions sum;
    sum.reduceOp = c10d::ReduceOp::SUM;
    nccl->allreduce(t, sum)->wait();
    EXPECT_TRUE(at::equal(t[0], expected)) << "all_reduce " << dtype;
    // all-gather and reduce-scatter into flat buffers, as the sharding engine calls them.
    at::Tensor in = expected.clone(), out = at::zeros_like(expected);
    nccl->_allgather_base(out, in)->wait();
    EXPECT_TRUE(at::equal(out, expected)) << "all_gather " << dtype;
    out.zero_();
    c10d::ReduceScatterOptions rs;
    rs.reduceOp = c10d::ReduceOp::SUM;
    nccl->_reduce_scatter_base(out, in, rs)->wait();
    EXPECT_TRUE(at::equal(out, expected)) << "reduce_scatter " << dtype;
    // broadcast from rank 0 and all-to-all (even and explicit splits), as Muon's owners use it.
    std::vector<at::Tensor> b{expected.clone()};
    nccl->broadcast(b)->wait();
    EXPECT_TRUE(at::equal(b[0], expected)) << "broadcast " << dtype;
    out.zero_();
    std::vector<int64_t> even, splits{1000};
    nccl->alltoall_base(out, in, even, even)->wait();
    EXPECT_TRUE(at::equal(out, expected)) << "all_to_all " << dtype;
    out.zero_();
    nccl->alltoall_base(out, in, splits, splits)->wait();
    EXPECT_TRUE(at::equal(out, expected)) << "all_to_all with splits " << dtype;
  }
  nccl->barrier()->wait();
  nccl->shutdown();
#endif
}

TEST(CudaData, PinnedBatchesReachTheGpuUnchanged) {
  SKIP_WITHOUT_GPU();
  // Training's path (Trainer::train_step): batches prefetched into pinned host memory, copied
  // to the GPU without waiting. The host batches are dropped right after their copies are
  // queued, so the loader reuses pinned blocks while earlier copies may still be in flight;
  // every GPU batch must still equal the batch a plain loader (no prefetch, pageable) gives.
  auto source = std::make_shared<FakeDataset>(5, 512, 32000);
  DataLoader plain(source, 0, /*shuffle=*/false, /*global_batch=*/16, /*micro_bs=*/4, 0, 1);
  DataLoader pinned(source, 0, false, 16, 4, 0, 1);
  pinned.start_prefetch(/*depth=*/2, /*pin_memory=*/true);
  std::vector<Batch> on_gpu;
  for (int i = 0; i < 12; ++i) {
    Batch b = pinned.next();
    ASSERT_TRUE(b.inputs.is_pinned()) << "batch " << i;
    ASSERT_TRUE(b.targets.is_pinned()) << "batch " << i;
    on_gpu.push_back({b.inputs.to(kGpu, /*non_blocking=*/true), b.targets.to(kGpu, /*non_blocking=*/true)});
  }
  for (int i = 0; i < 12; ++i) {
    const Batch expected = plain.next();
    EXPECT_FALSE(expected.inputs.is_pinned());
    EXPECT_TRUE(on_gpu[i].inputs.is_cuda());
    EXPECT_EQ(on_gpu[i].inputs.scalar_type(), at::kLong);
    EXPECT_TRUE(at::equal(on_gpu[i].inputs.cpu(), expected.inputs)) << "inputs of batch " << i;
    EXPECT_TRUE(at::equal(on_gpu[i].targets.cpu(), expected.targets)) << "targets of batch " << i;
  }
}

TEST(CudaFp32Updates, KernelsEqualAtensOperators) {
  SKIP_WITHOUT_GPU();
  // The gradient sums, Muon's momentum and update (kernels/fp32_updates.h) through our kernels and,
  // with "update" and "momentum" left unfused, through ATen's operators, on the same values: the
  // sums and their start equal (one rounding each way); the update within one fp32 rounding of the
  // result and of alpha * src (the kernel's fused multiply-add against ATen's add, which may round
  // the product first); the momentum and Nesterov's input
  // within two of the values' size (|buf| + |g|), as on the host (KernelsOnHost). Sizes with a
  // partial vector; a view off alignment goes through single values.
  at::manual_seed(22);
  const auto f32 = at::TensorOptions().device(kGpu);
  for (const int64_t n : {int64_t{4099}, int64_t{1} << 22}) {
    const at::Tensor g16 = (at::randn({n + 1}, f32) * 3).to(at::kBFloat16), g32 = at::randn({n}, f32);
    const at::Tensor d0 = at::randn({n}, f32), b0 = at::randn({n}, f32);
    std::vector<at::Tensor> got, want;
    for (const bool fused : {true, false}) {
      const KernelChoices k = KernelChoices::from(true, fused ? "" : "update, momentum", "flash");
      std::vector<at::Tensor>& out = fused ? got : want;
      at::Tensor sum = d0.clone(), off = d0.clone(), upd = d0.clone();
      scale_add_(sum, 1.0, g16.narrow(0, 0, n), 1.0, k);
      scale_add_(off, 1.0, g16.narrow(0, 1, n), 1.0, k);  // 2 bytes off: single values
      scale_add_(upd, 1.0 - 0.02 * 0.01, g16.narrow(0, 0, n), -0.02 * 0.7, k);
      out.push_back(sum);
      out.push_back(off);
      out.push_back(fp32_copy(g16.narrow(0, 0, n), k));
      out.push_back(upd);
      for (const bool nesterov : {true, false}) {
        const std::vector<at::Tensor> bufs{b0.clone()};
        const std::vector<at::Tensor> in = momentum_(bufs, {g32}, 0.95, nesterov, k);
        out.push_back(bufs[0]);
        out.push_back(in[0]);
      }
    }
    const std::string what = std::to_string(n) + " values";
    EXPECT_TRUE(at::equal(got[0], want[0])) << what << ": the sum";
    EXPECT_TRUE(at::equal(got[1], want[1])) << what << ": the sum, off alignment";
    EXPECT_TRUE(at::equal(got[2], want[2])) << what << ": the sum's start";
    const at::Tensor product = g16.narrow(0, 0, n).to(at::kFloat).abs() * 0.02 * 0.7;
    const at::Tensor step = (want[3].abs() + product) * std::ldexp(1.0, -23);
    EXPECT_EQ(((got[3] - want[3]).abs() > step + 1e-30).sum().item<int64_t>(), 0)
        << what << ": the update, worst " << (got[3] - want[3]).abs().max().item<double>();
    const at::Tensor size = (b0.abs() + g32.abs()) * std::ldexp(1.0, -22) + 1e-30;
    for (size_t i = 4; i < got.size(); ++i)
      EXPECT_EQ(((got[i] - want[i]).abs() > size).sum().item<int64_t>(), 0)
          << what << ": momentum output " << i - 4 << ", worst " << (got[i] - want[i]).abs().max().item<double>();
    EXPECT_TRUE(at::equal(got[7], got[6])) << "without Nesterov the input is the momentum itself";
  }
}

TEST(CudaResidualLinear, OneGemmWithinTheLinearsRounding) {
  SKIP_WITHOUT_GPU();
  // A block's output linear and residual add, h + x w^T, in bf16 on the GPU: one GEMM reading h in
  // its epilogue (fused on; cuBLASLt through gemm_add) and the linear then the add (unfused),
  // against float64 on the same bf16 values. PyTorch lets cuBLAS sum a bf16 GEMM's partial
  // products in bf16 (split-K; allow_bf16_reduced_precision_reduction), so a bound of one rounding
  // of the sum failed on an H100 (2026-11-26, worst 0.023 on values of size ~4): each element
  // within 2^-8 of the sum's size and of its terms' sizes (|h| + sum |x||w|, each partial sum
  // rounded at most once), both ways. h's gradient is the output's, unchanged, both ways; x's and
  // w's within the same kind of bound of g w and g^T x; our node, or the add's.
  at::manual_seed(17);
  const auto bf16 = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  const at::Tensor h0 = at::randn({4, 256, 1024}, bf16), x0 = at::randn({4, 256, 2048}, bf16),
                   w0 = at::randn({1024, 2048}, bf16) * 0.02, g = at::randn({4, 256, 1024}, bf16);
  const at::Tensor h64 = h0.to(at::kDouble), x64 = x0.to(at::kDouble), w64 = w0.to(at::kDouble),
                   g64 = g.to(at::kDouble);
  auto within = [](const at::Tensor& got, const at::Tensor& exact, const at::Tensor& terms, const std::string& what) {
    const at::Tensor bound = (exact.abs() + terms) * std::ldexp(1.0, -8);
    EXPECT_EQ(((got.to(at::kDouble) - exact).abs() > bound).sum().item<int64_t>(), 0)
        << what << ", worst " << (got.to(at::kDouble) - exact).abs().max().item<double>();
  };
  for (const bool fused : {true, false}) {
    at::Tensor h = h0.clone().requires_grad_(true), x = x0.clone().requires_grad_(true),
               w = w0.clone().requires_grad_(true);
    const at::Tensor y = residual_linear(h, x, w, KernelChoices::from(true, fused ? "" : "residual", "flash"));
    y.backward(g);
    const std::string what = fused ? "one GEMM" : "linear, then add";
    const std::string node = y.grad_fn()->name();
    EXPECT_NE(node.find(fused ? "ResidualLinear" : "AddBackward0"), std::string::npos) << what << ": " << node;
    within(y, h64 + at::linear(x64, w64), h64.abs() + at::linear(x64.abs(), w64.abs()), what + ": output");
    EXPECT_TRUE(at::equal(h.grad(), g)) << what << ": h's gradient is the output's";
    within(x.grad(), at::matmul(g64, w64), at::matmul(g64.abs(), w64.abs()), what + ": x's gradient");
    const at::Tensor g2 = g64.reshape({-1, 1024}), x2 = x64.reshape({-1, 2048});
    within(w.grad(), at::mm(g2.t(), x2), at::mm(g2.t().abs(), x2.abs()), what + ": w's gradient");
  }
}

TEST(CudaGemmAdd, CublasLtReadsTheAddedTermWithinAtensRounding) {
  SKIP_WITHOUT_GPU();
  // beta c + alpha a b by cuBLASLt with c read in the epilogue (kernels/gemm_add.h), in the layouts
  // its callers use: the residual GEMM (2-D, b a transposed view), and Newton-Schulz's batched
  // b A + c A A, a X + B X (wide) and a X + X B^T (tall). Against float64 on the same bf16 values,
  // with the bound of the test above, as ATen's baddbmm/addmm (which copy c first) within the same;
  // c itself left unchanged; and each of these layouts taken by cuBLASLt, not handed to ATen.
  at::manual_seed(23);
  const auto bf16 = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  const at::Tensor X = at::randn({3, 96, 160}, bf16) * 0.1, T = at::randn({3, 160, 96}, bf16) * 0.1;
  const at::Tensor A = at::bmm(X, X.mT()), B = at::randn({3, 96, 96}, bf16) * 0.1, Bt = at::randn({3, 96, 96}, bf16) * 0.1;
  const at::Tensor h = at::randn({256, 128}, bf16), x = at::randn({256, 320}, bf16), w = at::randn({128, 320}, bf16);
  struct Case {
    std::string name;
    at::Tensor c, a, b;
    double beta, alpha;
  };
  const std::vector<Case> cases{{"residual", h, x, w.t(), 1.0, 1.0},
                                {"b A + c A A", A, A, A, -4.775, 2.0315},
                                {"a X + B X", X, B, X, 3.4445, 1.0},
                                {"a X + X B^T", T, T, Bt.mT(), 3.4445, 1.0}};
  for (const Case& k : cases) {
    const at::Tensor before = k.c.clone();
#ifdef ZB_WITH_CUDA
    ASSERT_TRUE(gemm_add_cuda_applies(k.c, k.a, k.b)) << k.name;
    const at::Tensor got = gemm_add_cuda(k.c, k.a, k.b, k.beta, k.alpha);
    ASSERT_TRUE(got.defined()) << k.name << ": cuBLASLt offered no algorithm";
#else
    const at::Tensor got = gemm_add(k.c, k.a, k.b, k.beta, k.alpha, /*through_cublaslt=*/true);
#endif
    const at::Tensor aten = gemm_add(k.c, k.a, k.b, k.beta, k.alpha, /*through_cublaslt=*/false);
    EXPECT_TRUE(at::equal(k.c, before)) << k.name << ": c unchanged";
    EXPECT_TRUE(got.is_contiguous() && got.sizes() == k.c.sizes() && got.scalar_type() == at::kBFloat16) << k.name;
    const at::Tensor c64 = k.c.to(at::kDouble), a64 = k.a.to(at::kDouble), b64 = k.b.to(at::kDouble);
    const at::Tensor exact = c64 * k.beta + at::matmul(a64, b64) * k.alpha;
    const at::Tensor bound =
        (exact.abs() + c64.abs() * std::abs(k.beta) + at::matmul(a64.abs(), b64.abs()) * std::abs(k.alpha)) *
        std::ldexp(1.0, -8);
    for (const auto& [what, y] : {std::pair<std::string, at::Tensor>{"cuBLASLt", got}, {"ATen", aten}})
      EXPECT_EQ(((y.to(at::kDouble) - exact).abs() > bound).sum().item<int64_t>(), 0)
          << k.name << " by " << what << ", worst " << (y.to(at::kDouble) - exact).abs().max().item<double>();
  }
}

// Float8 linears through cuBLASLt's FP8 GEMMs (_scaled_mm) against the same FP8 values multiplied
// in fp32 (float8.emulate), each recipe, forward and backward: the GPU's accumulation (the
// forward's fast mode) and the bf16 outputs' rounding apart, the same products.
TEST(CudaFloat8, ScaledMmEqualsTheEmulation) {
  SKIP_WITHOUT_GPU();
  if (device_compute_capability(kGpu) < 89) GTEST_SKIP() << device_name(kGpu) << " has no FP8 tensor cores";
  at::manual_seed(0);
  const auto bf16 = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  const at::Tensor x0 = at::randn({2, 128, 512}, bf16), w0 = at::randn({384, 512}, bf16) * 0.02;
  const at::Tensor g0 = at::randn({2, 128, 384}, bf16);
  for (Float8Recipe recipe : {Float8Recipe::Tensorwise, Float8Recipe::Rowwise, Float8Recipe::RowwiseWithGwHp}) {
    at::Tensor out[2][3];
    for (int emulate = 0; emulate < 2; ++emulate) {
      const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      const at::Tensor y = float8_linear(x, w, recipe, emulate == 1);
      y.backward(g0);
      out[emulate][0] = y;
      out[emulate][1] = x.grad();
      out[emulate][2] = w.grad();
      EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    }
    for (int i = 0; i < 3; ++i)
      EXPECT_LT(relative_error(out[0][i], out[1][i]), 5e-3) << float8_recipe_name(recipe) << " output " << i;
  }
}

// Our one-pass FP8 cast (kernels/float8_cast_kernel.cu) against ATen's operators on the GPU: the
// same bytes and scales, for a matrix and a transposed view, each scaling.
TEST(CudaFloat8, OurCastEqualsAtensBitForBit) {
  SKIP_WITHOUT_GPU();
  at::manual_seed(1);
  const at::Tensor x = (at::randn({96, 160}, at::TensorOptions().device(kGpu)) *
                        at::exp2(at::randint(-10, 8, {96, 160}, at::TensorOptions().device(kGpu)).to(at::kFloat)))
                           .to(at::kBFloat16);
  for (const at::Tensor& m : {x, x.t()}) {
#ifdef ZB_WITH_CUDA
    ASSERT_TRUE(float8_cast_cuda_applies(m)) << "our kernel does not take the matrix: both sides would be ATen's";
#endif
    for (const at::ScalarType fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2})
      for (const auto& [rowwise, power_of_two] : {std::pair{false, false}, {false, true}, {true, true}}) {
        const Float8Tensor ours = to_float8(m, fp8, rowwise, power_of_two, /*our_kernel=*/true);
        const Float8Tensor aten = to_float8(m, fp8, rowwise, power_of_two, /*our_kernel=*/false);
        EXPECT_TRUE(ours.data.contiguous().view(at::kByte).equal(aten.data.contiguous().view(at::kByte)))
            << c10::toString(fp8) << " rowwise " << rowwise << " transposed " << !m.is_contiguous();
        EXPECT_TRUE(ours.inverse_scale.equal(aten.inverse_scale)) << c10::toString(fp8) << " rowwise " << rowwise;
      }
  }
}

// Context parallelism through the variable-length flash kernel (runtime.cp_varlen) against the
// mask through SDPA, on the GPU in bf16, forward and the gradients of q and of the gathered keys
// and values: the pieces' causal mask aligned at their ends (Attention.CpVarlenPiecesSeeWhatTheMaskSees
// checks the pieces on the CPU; here the kernel's alignment).
TEST(CudaAttention, CpVarlenEqualsTheMask) {
  SKIP_WITHOUT_GPU();
  at::manual_seed(5);
  const int64_t B = 2, T = 512, H = 8, Hkv = 4, Dh = 64;
  const auto bf16 = at::TensorOptions().device(kGpu).dtype(at::kBFloat16);
  const at::Tensor cu = at::tensor(std::vector<int32_t>{0, 40, 47, 300, 512, 700, 701, 1024}, at::kInt);
  for (const int64_t size : {2, 4})
    for (int64_t rank = 0; rank < size; ++rank) {
      const int64_t t = T / size;
      const at::Tensor q0 = at::randn({B, t, H, Dh}, bf16), k0 = at::randn({B, T, Hkv, Dh}, bf16),
                       v0 = at::randn({B, T, Hkv, Dh}, bf16), g = at::randn({B, t, H * Dh}, bf16);
      at::Tensor out[2], dq[2], dk[2], dv[2];
      for (int way = 0; way < 2; ++way) {
        const at::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
                         v = v0.clone().requires_grad_(true);
        const Documents d = way == 0 ? cp_varlen_documents(cu, B, T, rank, size, kGpu)
                                     : cp_documents(cu, B, T, rank, size, kGpu, at::kBFloat16);
        out[way] = attention(q, k, v, d);
        out[way].backward(g);
        dq[way] = q.grad(), dk[way] = k.grad(), dv[way] = v.grad();
      }
      const std::string what = "cp " + std::to_string(size) + " rank " + std::to_string(rank);
      EXPECT_LT(relative_error(out[0], out[1]), 2e-2) << what;
      EXPECT_LT(relative_error(dq[0], dq[1]), 2e-2) << what;
      EXPECT_LT(relative_error(dk[0], dk[1]), 2e-2) << what;
      EXPECT_LT(relative_error(dv[0], dv[1]), 2e-2) << what;
    }
}

// The routed experts on a GPU (model/moe.h): in bf16 through ATen's grouped GEMM, in fp32 through
// one product per expert, against the fp32 CPU computation of the same routing; with one expert
// left without tokens, and with every token sent to one expert. bf16's tolerance as
// CudaModel's (each product's inputs and outputs rounded to 8 bits); fp32 within TF32-free fp32.
TEST(CudaMoE, RoutedExpertsMatchTheCpuInBf16AndFp32) {
  SKIP_WITHOUT_GPU();
  at::manual_seed(6);
  const int64_t N = 512, D = 256, E = 8, F = 384;
  for (const bool one_expert : {false, true}) {
    const at::Tensor x0 = at::randn({N, D}), gate0 = at::randn({E, D}) * 0.1;
    const at::Tensor w10 = at::randn({E, F, D}) * 0.05, w20 = at::randn({E, D, F}) * 0.05,
                     w30 = at::randn({E, F, D}) * 0.05, g = at::randn({N, D});
    at::Tensor bias = at::zeros({E});
    if (one_expert) bias[3] = 100.0;  // every token's first choice: expert 3
    else bias[5] = -100.0;            // expert 5 gets no token
    RouterConfig router;
    router.num_experts = E, router.top_k = 2, router.route_norm = true;
    auto run = [&](const c10::Device& device, at::ScalarType dtype) {
      auto leaf = [&](const at::Tensor& t) { return t.to(device).detach().requires_grad_(true); };
      const at::Tensor x = leaf(x0), gate = leaf(gate0), w1 = leaf(w10), w2 = leaf(w20), w3 = leaf(w30);
      const Routing r = route(x, gate, bias.to(device), router);  // the same routes on both devices
      const at::Tensor out = routed_experts(x.to(dtype), r, w1, w2, w3);
      EXPECT_EQ(out.scalar_type(), dtype);
      (out.to(at::kFloat) * g.to(device)).sum().backward();
      return std::vector<at::Tensor>{out, x.grad(), gate.grad(), w1.grad(), w2.grad(), w3.grad()};
    };
    const std::vector<at::Tensor> cpu = run(c10::Device(c10::kCPU), at::kFloat);
    const char* names[] = {"output", "x's gradient", "gate's gradient", "w1's gradient", "w2's gradient", "w3's gradient"};
    for (const auto& [dtype, tolerance] : {std::pair{at::kBFloat16, 5e-2}, std::pair{at::kFloat, 1e-4}}) {
      const std::vector<at::Tensor> gpu = run(kGpu, dtype);
      for (size_t i = 0; i < gpu.size(); ++i) {
        ASSERT_TRUE(gpu[i].defined()) << names[i];
        if (!one_expert && i >= 3)  // the expert without tokens: a zero gradient
          EXPECT_EQ(gpu[i][5].abs().max().item<double>(), 0.0) << names[i];
        EXPECT_LT(relative_error(gpu[i], cpu[i]), tolerance)
            << names[i] << " in " << c10::toString(dtype) << (one_expert ? ", every token to one expert" : "");
      }
    }
  }
}

// A mixture of experts' model trains on the GPU as on the CPU (CudaModel's comparison): bf16
// against fp32, the loss and every gradient, the experts' stacks and the gate included.
TEST(CudaMoE, MixtureModelBf16MatchesFp32OnCpu) {
  SKIP_WITHOUT_GPU();
  ModelArgs a = lookup_model_args("llama2", "debugmodel");
  a.dim = 512, a.n_layers = 3, a.n_heads = 8, a.n_kv_heads = 8, a.vocab_size = 2048, a.max_seq_len = 256;
  a.num_experts = 8, a.top_k = 2, a.moe_inter_dim = 512, a.num_shared_experts = 1, a.n_dense_layers = 1;
  a.score_func = "sigmoid", a.route_norm = true;
  // bf16 scores can choose another expert where two are within rounding of each other: a few
  // tokens' routes differ, which the loss averages out and the gradients carry (hence the dense
  // model's tolerances, not tighter ones).
  expect_bf16_gpu_matches_fp32_cpu(a, [&](const Llama& gpu) {
    // The routing's counts, on the device: every token's two experts, once.
    for (int64_t l = 1; l < a.n_layers; ++l)
      EXPECT_EQ(gpu.expert_loads()[l].tokens.sum().item<int64_t>(), 4 * 256 * 2);
  });
}
