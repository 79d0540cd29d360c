// Our CUDA kernels' code run on the CPU, every thread of a grid in turn (kernels/cuda_kernels.h):
// what a machine without a GPU can check of them, their indexing (16-byte vectors, the single
// values after them, pointers off alignment, grids smaller than the work) and their arithmetic,
// against ATen's fp32 operators rounded to bf16 where ATen's CUDA kernels round. The GPU's own run
// is tests/test_cuda.cpp's.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "float8/float8.h"
#include "model/layers.h"

#ifdef ZB_WITH_CUDA
#include "kernels/cuda_kernels.h"
#endif

namespace {

#ifdef ZB_WITH_CUDA
// bf16 values on the CPU whose data starts `offset` elements (2 bytes each) into their storage.
at::Tensor bf16_values(int64_t n, int64_t offset) {
  return (at::randn({n + offset}) * 4).to(at::kBFloat16).narrow(0, offset, n);
}

// Elements of `got` more than one bf16 step (2^-7 relative, 2^-14 absolute) from `want`, and
// elements that differ at all. A NaN (an element no thread wrote) counts in both.
std::pair<int64_t, int64_t> differences(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor x = got.to(at::kFloat), y = want.to(at::kFloat);
  const at::Tensor far = ((x - y).abs() > y.abs() * std::ldexp(1.0, -7) + std::ldexp(1.0, -14)).logical_or(x.isnan());
  return {far.sum().item<int64_t>(), x.ne(y).sum().item<int64_t>()};
}
#endif

}  // namespace

TEST(KernelsOnHost, SiluMulCoversEveryElementWithAtensRounding) {
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "built against a LibTorch without CUDA: no kernels";
#else
  at::manual_seed(6);
  int cases = 0;
  for (const int64_t n : {0, 1, 7, 8, 9, 64, 4099, 2 * 5632 + 5})
    for (const int64_t offset : {0, 1})  // aligned (vectors, then single values), or not (single values)
      for (const int64_t threads : {0, 1, 37}) {  // the launch's grid, and grids smaller than the work
        const std::string what = "n " + std::to_string(n) + ", offset " + std::to_string(offset) + ", threads " +
                                 std::to_string(threads);
        const at::Tensor a = bf16_values(n, offset), b = bf16_values(n, offset), g = bf16_values(n, offset);
        at::Tensor out = bf16_values(n, offset).fill_(NAN), ga = bf16_values(n, offset).fill_(NAN),
                   gb = bf16_values(n, offset).fill_(NAN);
        zb::silu_mul_bf16_on_host(a.const_data_ptr(), b.const_data_ptr(), out.mutable_data_ptr(), n, threads);
        zb::silu_mul_backward_bf16_on_host(g.const_data_ptr(), a.const_data_ptr(), b.const_data_ptr(),
                                           ga.mutable_data_ptr(), gb.mutable_data_ptr(), n, threads);
        // ATen's CUDA operators in bf16: SiLU rounds its output, mul its product; backward, the
        // product's rule (g * b rounded) then SiLU's backward, and g * silu(a).
        const at::Tensor af = a.to(at::kFloat), bf = b.to(at::kFloat), gf = g.to(at::kFloat);
        const at::Tensor s = (af / (1 + at::exp(-af))).to(at::kBFloat16).to(at::kFloat);
        const at::Tensor sig = 1 / (1 + at::exp(-af));
        const at::Tensor want_out = (s * bf).to(at::kBFloat16);
        const at::Tensor want_ga =
            ((gf * bf).to(at::kBFloat16).to(at::kFloat) * sig * (1 + af * (1 - sig))).to(at::kBFloat16);
        const at::Tensor want_gb = (gf * s).to(at::kBFloat16);
        for (const auto& [name, got, want] : {std::tuple{"forward", out, want_out}, std::tuple{"gradient of a", ga, want_ga},
                                              std::tuple{"gradient of b", gb, want_gb}}) {
          const auto [far, differ] = differences(got, want);
          EXPECT_EQ(far, 0) << what << ", " << name << ": elements missed or more than one bf16 step off";
          // The CPU's exp (ATen's vectorised one against the C library's expf) may round an
          // element differently now and then; nearly all are the same bits.
          EXPECT_LE(differ, n / 100 + 1) << what << ", " << name;
        }
        ++cases;
      }
  EXPECT_EQ(cases, 8 * 2 * 3);
#endif
}

TEST(KernelsOnHost, RopeCoversEveryPairWithTheUnfusedPathsRounding) {
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "built against a LibTorch without CUDA: no kernels";
#else
  // x [B, T, H, Dh] in bf16 rotated by the table's first T rows (and by their conjugate, as
  // backward does), against apply_rope_unfused on the CPU: the same fp32 products rounded to bf16.
  // Heads whose pairs come in fours (16-byte accesses) and a head of 3 pairs (single pairs); x 4
  // bytes off alignment in every other case (single pairs).
  at::manual_seed(7);
  int cases = 0;
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{2, 16, 3, 8}, std::vector<int64_t>{1, 5, 40, 64}, std::vector<int64_t>{1, 4, 5, 6}})
    for (const bool conjugate : {false, true})
      for (const auto& [blocks, threads] : {std::pair<int64_t, int>{0, 0}, {1, 32}, {3, 7}}) {
        const std::string what = "shape " + std::to_string(shape[1]) + "x" + std::to_string(shape[2]) + "x" +
                                 std::to_string(shape[3]) + (conjugate ? ", conjugate" : "") + ", grid " +
                                 std::to_string(blocks) + " x " + std::to_string(threads);
        const int64_t B = shape[0], T = shape[1], H = shape[2], Dh = shape[3];
        const zb::RopeTables rope = zb::rope_tables(Dh, 2 * T, 10000.0, at::kFloat);
        const int64_t offset = cases % 2 == 1 ? 2 : 0, numel = B * T * H * Dh;
        const at::Tensor x = at::randn({numel + offset}).to(at::kBFloat16).narrow(0, offset, numel).view(shape);
        const at::Tensor pairs = at::view_as_real(rope.cis.slice(0, 0, T)).contiguous();  // [T, Dh/2, 2] fp32
        at::Tensor out = at::full(shape, NAN, x.options());
        zb::rope_bf16_on_host(x.const_data_ptr(), out.mutable_data_ptr(), pairs.const_data_ptr(), B * T, T, H, Dh / 2,
                              conjugate, blocks, threads);
        const zb::RopeTables table = conjugate ? zb::RopeTables{rope.cis.conj().resolve_conj()} : rope;
        const auto [far, differ] = differences(out, zb::apply_rope_unfused(x, table));
        EXPECT_EQ(far, 0) << what << ": pairs missed or more than one bf16 step off";
        EXPECT_LE(differ, out.numel() / 100 + 1) << what;
        ++cases;
      }
  EXPECT_EQ(cases, 3 * 2 * 3);
#endif
}

TEST(KernelsOnHost, SoftmaxGradCoversEveryLogitWithAtensRounding) {
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "built against a LibTorch without CUDA: no kernels";
#else
  // The chunked loss's gradient of its logits against the path it replaces (model/chunked_loss.cpp)
  // on the CPU: z - lse and exp in place, -1 scattered at the target, cast to bf16. Widths that are
  // multiples of 4 (vectors) and not (single values), z off 16-byte alignment (single values), grids
  // smaller than the work, and a vocabulary split over ranks (vocab_start 5: targets below it or
  // past the slice get no one-hot here).
  at::manual_seed(8);
  int cases = 0;
  for (const auto& [rows, V] : {std::pair<int64_t, int64_t>{0, 8}, {1, 1}, {3, 37}, {17, 1000}, {6, 4}})
    for (const int64_t offset : {0, 1})
      for (const int64_t vocab_start : {0, 5})
        for (const auto& [blocks, threads] : {std::pair<int64_t, int>{0, 0}, {1, 1}, {3, 7}}) {
          const std::string what = std::to_string(rows) + " x " + std::to_string(V) + ", offset " +
                                   std::to_string(offset) + ", vocab_start " + std::to_string(vocab_start) + ", grid " +
                                   std::to_string(blocks) + " x " + std::to_string(threads);
          const at::Tensor z = (at::randn({rows * V + offset}) * 3).narrow(0, offset, rows * V).view({rows, V});
          const at::Tensor lse = at::logsumexp(z, {1}, /*keepdim=*/true);
          const at::Tensor targets = at::randint(0, V + 2 * vocab_start, {rows}, at::kLong);
          at::Tensor g = at::full({rows, V}, NAN, at::TensorOptions().dtype(at::kBFloat16));
          zb::softmax_grad_bf16_on_host(z.const_data_ptr(), lse.const_data_ptr(), targets.const_data_ptr(),
                                        vocab_start, g.mutable_data_ptr(), rows, V, blocks, threads);
          // ATen's path, as chunked_loss.cpp writes it for a split vocabulary.
          at::Tensor want = z.clone();
          want.sub_(lse).exp_();
          const at::Tensor local = targets.unsqueeze(1) - vocab_start;
          const at::Tensor here = local.ge(0).logical_and(local.lt(V));
          want.scatter_add_(1, local.clamp(0, std::max<int64_t>(V - 1, 0)),
                            at::where(here, at::full_like(local, -1, want.options()), at::zeros({1}, want.options())));
          const auto [far, differ] = differences(g, want.to(at::kBFloat16));
          EXPECT_EQ(far, 0) << what << ": logits missed or more than one bf16 step off";
          EXPECT_LE(differ, g.numel() / 100 + 1) << what;
          ++cases;
        }
  EXPECT_EQ(cases, 5 * 2 * 2 * 3);
#endif
}

TEST(KernelsOnHost, RowLogSumExpEqualsAtensWithinFp32Rounding) {
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "built against a LibTorch without CUDA: no kernels";
#else
  // Each row's log-sum-exp in one pass (a running maximum, the sum relative to it, threads' shares
  // combined pairwise) against at::logsumexp in float64 on the same fp32 values. Widths that are
  // multiples of 4 (vectors) and not, z off 16-byte alignment (single values), more threads than
  // columns, rows whose values span 60 (the running maximum rescales), a row growing all along
  // (every value a new maximum), one with -inf entries (a vocabulary's masked words), one all
  // -inf (log(0)), one with a NaN (NaN, never dropped) and one with a +inf (+inf). The threads'
  // shares are combined in the GPU's shuffle order (kernels/block_reduce_host.h). Within 4 fp32 steps of the float64 result's magnitude: expf and logf are
  // within 2 ulps each, the sums add a few more roundings relative to values of size log(V).
  at::manual_seed(9);
  int cases = 0;
  for (const auto& [rows, V] : {std::pair<int64_t, int64_t>{0, 8}, {1, 1}, {3, 37}, {17, 1000}, {6, 4}, {2, 32000}})
    for (const int64_t offset : {0, 1})
      for (const int threads : {0, 1, 7, 64}) {
        const std::string what = std::to_string(rows) + " x " + std::to_string(V) + ", offset " +
                                 std::to_string(offset) + ", threads " + std::to_string(threads);
        at::Tensor z = (at::randn({rows * V + offset}) * 20).narrow(0, offset, rows * V).view({rows, V});
        if (rows >= 3) {
          z[1].copy_(at::arange(V, at::kFloat) * 0.01);  // increasing: every value rescales the sum
          z[2].narrow(0, 0, (V + 1) / 2).fill_(-INFINITY);
          // A diverged logit in the last column: with many threads its thread's shuffle partners
          // have no columns (-inf), and the NaN must survive meeting them.
          z[0][V - 1] = NAN;
        }
        if (rows >= 6) {
          z[5].fill_(-INFINITY);
          z[4][V / 2] = INFINITY;  // +inf: the result +inf, as ATen's
        }
        at::Tensor lse = at::full({rows}, NAN);
        zb::row_logsumexp_fp32_on_host(z.const_data_ptr(), lse.mutable_data_ptr(), rows, V, threads);
        const at::Tensor want = at::logsumexp(z.to(at::kDouble), {1});
        const at::Tensor finite = want.isfinite();
        const at::Tensor off = ((lse.to(at::kDouble) - want).abs() > want.abs() * 4 * std::ldexp(1.0, -23) + 1e-6)
                                   .logical_and(finite)
                                   .logical_or(lse.isnan().logical_and(finite));
        EXPECT_EQ(off.sum().item<int64_t>(), 0) << what << ": " << lse << " against " << want;
        EXPECT_TRUE(lse.masked_select(want.isneginf()).eq(-INFINITY).all().item<bool>()) << what;
        EXPECT_TRUE(lse.masked_select(want.isposinf()).eq(INFINITY).all().item<bool>()) << what;
        EXPECT_TRUE(lse.masked_select(want.isnan()).isnan().all().item<bool>()) << what;
        EXPECT_EQ(want.isnan().sum().item<int64_t>(), rows >= 3 ? 1 : 0) << what;
        EXPECT_EQ(want.isposinf().sum().item<int64_t>(), rows >= 6 ? 1 : 0) << what;
        ++cases;
      }
  EXPECT_EQ(cases, 6 * 2 * 4);
#endif
}

TEST(KernelsOnHost, RmsNormBackwardAddsTheResidualsGradientInOnePass) {
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "built against a LibTorch without CUDA: no kernels";
#else
  // RMSNorm's backward with the residual stream's gradient (kernels/rms_norm_kernel.cu) against its
  // formula in float64 on the same bf16 values: dh = rstd * (w * dy - x_hat * mean(w * dy * x_hat))
  // + residual, rounded to bf16 once (so within one bf16 step, 2^-7 relative: ATen's own fused
  // backward rounds the norm's part and the add separately); dw = the sum over rows of
  // dy * x_hat, from the blocks' fp32 partial sums, within 1e-4 of the largest (a sum of 50 fp32
  // products of size ~1-10). Widths of one vector (8) to several per thread (a grid of 7 threads
  // over 24 vectors), grids smaller than the rows, and with no residual.
  at::manual_seed(11);
  int cases = 0;
  for (const auto& [rows, D] : {std::pair<int64_t, int64_t>{1, 8}, {5, 64}, {50, 192}, {3, 2048}})
    for (const bool with_residual : {true, false})
      for (const auto& [blocks, threads] : {std::pair<int64_t, int>{0, 0}, {2, 7}, {1, 32}}) {
        if (D / 8 > int64_t{threads == 0 ? 256 : threads} * 4) continue;  // wider than 4 vectors a thread
        const std::string what = std::to_string(rows) + " x " + std::to_string(D) + (with_residual ? ", residual" : "") +
                                 ", grid " + std::to_string(blocks) + " x " + std::to_string(threads);
        const auto bf = at::TensorOptions().dtype(at::kBFloat16);
        const at::Tensor h = (at::randn({rows, D}) * 2).to(at::kBFloat16), dy = at::randn({rows, D}).to(at::kBFloat16);
        const at::Tensor w = (at::rand({D}) + 0.5).to(at::kBFloat16);
        const at::Tensor residual = with_residual ? at::randn({rows, D}).to(at::kBFloat16) : at::Tensor();
        const at::Tensor hd = h.to(at::kDouble), rstd = (hd.pow(2).mean(-1) + 1e-5).rsqrt();
        const at::Tensor rstd32 = rstd.to(at::kFloat);
        at::Tensor dh = at::full({rows, D}, NAN, bf);
        const int64_t grid = blocks == 0 ? zb::rms_norm_backward_bf16_blocks(rows) : blocks;
        at::Tensor partial = at::full({grid, D}, NAN);
        zb::rms_norm_backward_bf16_on_host(dy.const_data_ptr(), h.const_data_ptr(), w.const_data_ptr(),
                                           rstd32.const_data_ptr(), with_residual ? residual.const_data_ptr() : nullptr,
                                           dh.mutable_data_ptr(), partial.mutable_data_ptr(), rows, D, blocks, threads);
        const at::Tensor r = rstd32.to(at::kDouble).unsqueeze(1), x_hat = hd * r, wg = dy.to(at::kDouble) * w.to(at::kDouble);
        at::Tensor want = r * (wg - x_hat * (wg * x_hat).mean(-1, true));
        if (with_residual) want = want + residual.to(at::kDouble);
        const at::Tensor got = dh.to(at::kDouble);
        const at::Tensor far = ((got - want).abs() > want.abs() * std::ldexp(1.0, -7) + std::ldexp(1.0, -14)).logical_or(got.isnan());
        EXPECT_EQ(far.sum().item<int64_t>(), 0) << what << ": dh more than one bf16 step off";
        const at::Tensor dw = partial.to(at::kDouble).sum(0), dw_want = (dy.to(at::kDouble) * x_hat).sum(0);
        EXPECT_LT((dw - dw_want).abs().max().item<double>(), 1e-4 * dw_want.abs().max().item<double>() + 1e-6) << what;
        ++cases;
      }
  EXPECT_EQ(cases, 4 * 2 * 3 - 4);  // 2,048 wide is 256 vectors: past 7 or 32 threads' 4 each
#endif
}

TEST(KernelsOnHost, Fp32UpdatesEqualAtensOperators) {
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "built against a LibTorch without CUDA: no kernels";
#else
  // The fp32 updates (kernels/fp32_update_kernel.cu) over sizes with and without a partial vector,
  // pointers off alignment (single values), grids smaller than the work, bf16 and fp32 sources:
  //   a gradient sum (keep 1, alpha 1) and its start (dst unread) equal ATen's add_ and copy (one
  //   rounding, the same); Muon's update (keep = the decay, alpha = -lr * scale) within one fp32
  //   rounding of the exact fma of the decayed value (the multiply rounded first), and of ATen's
  //   mul_ then add_ within that and the rounding of alpha * src ATen may make first;
  //   the momentum within two fp32 roundings of the values' size (|buf| + |g|) of ATen's lerps
  //   (each lerp one or two roundings; the grouping of its multiply-add may differ).
  at::manual_seed(21);
  int cases = 0;
  for (const int64_t n : {0, 1, 5, 4099})
    for (const int64_t offset : {0, 1})
      for (const int threads : {0, 1, 7})
        for (const bool bf16_src : {true, false}) {
          const std::string what = std::to_string(n) + " values, offset " + std::to_string(offset) + ", threads " +
                                   std::to_string(threads) + (bf16_src ? ", bf16" : ", fp32");
          const at::Tensor src =
              (at::randn({n + offset}) * 3).to(bf16_src ? at::kBFloat16 : at::kFloat).narrow(0, offset, n);
          const at::Tensor d0 = at::randn({n + offset}).narrow(0, offset, n);
          at::Tensor sum = d0.clone(), start = at::full({n}, NAN), upd = d0.clone();
          zb::scale_add_fp32_on_host(sum.mutable_data_ptr(), src.const_data_ptr(), bf16_src, 1.0f, 1.0f, true, n,
                                     threads);
          zb::scale_add_fp32_on_host(start.mutable_data_ptr(), src.const_data_ptr(), bf16_src, 0.0f, 1.0f, false, n,
                                     threads);
          const float keep = static_cast<float>(1.0 - 0.02 * 0.01), alpha = static_cast<float>(-0.02 * 0.7);
          zb::scale_add_fp32_on_host(upd.mutable_data_ptr(), src.const_data_ptr(), bf16_src, keep, alpha, true, n,
                                     threads);
          EXPECT_TRUE(at::equal(sum, d0.clone().add_(src))) << what << ": the sum";
          EXPECT_TRUE(at::equal(start, src.to(at::kFloat))) << what << ": the start";
          const at::Tensor decayed = d0.clone().mul_(keep).to(at::kDouble);
          const at::Tensor exact = decayed + static_cast<double>(alpha) * src.to(at::kDouble);
          const at::Tensor step = exact.abs() * std::ldexp(1.0, -23) + 1e-30;
          EXPECT_EQ(((upd.to(at::kDouble) - exact).abs() > step).sum().item<int64_t>(), 0) << what << ": the update";
          // ATen may round alpha * src before adding: that rounding too.
          const at::Tensor aten = d0.clone().mul_(keep).add_(src, alpha).to(at::kDouble);
          const at::Tensor steps = (exact.abs() + (static_cast<double>(alpha) * src.to(at::kDouble)).abs()) *
                                   std::ldexp(1.0, -23) + 1e-30;
          EXPECT_EQ(((upd.to(at::kDouble) - aten).abs() > steps).sum().item<int64_t>(), 0) << what << ": vs ATen";

          if (bf16_src) {  // the momentum has fp32 operands only
            const double mu = 0.95;
            const at::Tensor g = at::randn({n + offset}).narrow(0, offset, n);
            const at::Tensor b0 = at::randn({n + offset}).narrow(0, offset, n);
            for (const bool nesterov : {true, false}) {
              at::Tensor buf = b0.clone(), out = at::full({n}, NAN);
              zb::momentum_fp32_on_host(buf.mutable_data_ptr(), g.const_data_ptr(),
                                        nesterov ? out.mutable_data_ptr() : nullptr, static_cast<float>(1.0 - mu),
                                        static_cast<float>(mu), n, threads);
              std::vector<at::Tensor> want_buf{b0.clone()};
              at::_foreach_lerp_(want_buf, {g}, 1.0 - mu);
              const at::Tensor size = (b0.abs() + g.abs()) * std::ldexp(1.0, -22) + 1e-30;
              EXPECT_EQ(((buf - want_buf[0]).abs() > size).sum().item<int64_t>(), 0) << what << ": the momentum";
              if (nesterov) {
                const at::Tensor want_out = at::_foreach_lerp({g}, want_buf, mu)[0];
                EXPECT_EQ(((out - want_out).abs() > size).sum().item<int64_t>(), 0) << what << ": Nesterov's input";
              } else {
                EXPECT_TRUE(out.isnan().all().item<bool>()) << what << ": no output without Nesterov";
              }
            }
          }
          ++cases;
        }
  EXPECT_EQ(cases, 4 * 2 * 3 * 2);
#endif
}

TEST(KernelsOnHost, Float8CastEqualsAtensCastBitForBit) {
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "built against a LibTorch without CUDA: no kernels";
#else
  at::manual_seed(9);
  int cases = 0;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{4, 16}, {5, 13}, {33, 40}})  // vectors, or single values
    for (const int kind : {zb::kFloat8ScaleTensor, zb::kFloat8ScaleRow, zb::kFloat8ScaleColumn})
      for (const at::ScalarType fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2})
        for (const bool power_of_two : {false, true})
          for (const int64_t threads : {0, 7}) {
            const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " kind " +
                                     std::to_string(kind) + " " + c10::toString(fp8) + " pow2 " +
                                     std::to_string(power_of_two) + " threads " + std::to_string(threads);
            // Values over many magnitudes, a zero row, and one past the FP8 range after scaling
            // cannot happen (the amax scales to the top), so saturation shows only as the top.
            at::Tensor x = (at::randn({rows, cols}) * at::exp2(at::randint(-10, 8, {rows, cols}).to(at::kFloat)))
                               .to(at::kBFloat16);
            x[1].zero_();
            // ATen's cast, on the matrix for tensor and row scales, on its transpose for column scales.
            const bool columns = kind == zb::kFloat8ScaleColumn;
            const zb::Float8Tensor want = zb::to_float8(columns ? x.t() : x, fp8, kind != zb::kFloat8ScaleTensor,
                                                    power_of_two, /*our_kernel=*/false);
            const at::Tensor amax = kind == zb::kFloat8ScaleTensor ? x.to(at::kFloat).abs().amax().reshape({1})
                                                               : x.to(at::kFloat).abs().amax(columns ? 0 : 1);
            at::Tensor data = at::empty({rows, cols}, at::TensorOptions().dtype(fp8));
            at::Tensor inverse = at::full(amax.sizes(), NAN);
            zb::cast_to_float8_bf16_on_host(x.const_data_ptr(), amax.const_data_ptr(), kind, fp8 == at::kFloat8_e5m2,
                                        power_of_two, data.mutable_data_ptr(), inverse.mutable_data_ptr(), rows, cols,
                                        threads);
            const at::Tensor want_data = columns ? want.data.t() : want.data;
            EXPECT_TRUE(data.view(at::kByte).equal(want_data.contiguous().view(at::kByte))) << what;
            EXPECT_TRUE(inverse.equal(want.inverse_scale.reshape({-1}))) << what;
            ++cases;
          }
  EXPECT_EQ(cases, 72);
#endif
}
