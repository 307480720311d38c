// CUDA NVFP4 quantization / dequantization (semantics §6, "NVFP4") against the CPU implementation on the same inputs,
// bit for bit: T in {0, 1, 7, 128, 4096}, H in {64, 2048, 2880, 7168}, bfloat16 and float32 input, linear and swizzled
// scales, a host or a device global scale, strided outputs, outputs poisoned first. A dense sweep puts every e2m1
// boundary (ties), zero blocks, saturating values and subnormal e4m3 scales through both; the GPU round trip keeps the
// float64 model's error bound; the masked slab dequantization of the low-latency layout writes the counted rows only.
#include <gtest/gtest.h>

#include <epmoe/nvfp4.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gpu/gpu_util.hpp"
#include "quant/quant.hpp"
#include "support/nvfp4_reference.hpp"
#include "support/quant_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::same_bits;
using gputest::to_device;
using gputest::to_host;

Tensor host_scalar(float v) {
  Tensor t = Tensor::empty(DType::fp32, Shape{});
  *t.ptr<float>() = v;
  return t;
}

Tensor as_dtype(const std::vector<float>& v, DType dtype, std::int64_t T, std::int64_t H) {
  Tensor x = Tensor::empty(dtype, {T, H});
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::bf16)
      x.ptr<bf16_t>()[i] = float_to_bf16(v[i]);
    else
      x.ptr<float>()[i] = v[i];
  }
  return x;
}

// Blocks of varied magnitude (2^-40 .. 2^40), some zero, some holding an inf or a NaN.
std::vector<float> random_values(std::mt19937_64& rng, std::int64_t T, std::int64_t H) {
  std::vector<float> v(static_cast<std::size_t>(T * H));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> k(-40, 40), pct(0, 99);
  for (std::int64_t b = 0; b < T * H / 16; ++b) {
    const int p = pct(rng);
    const float mag = std::ldexp(1.0f, k(rng));
    for (int i = 0; i < 16; ++i) {
      float x = p < 4 ? 0.0f : u(rng) * mag;
      if (p == 5 && i == 2) x = -std::numeric_limits<float>::infinity();
      if (p == 6 && i == 9) x = std::numeric_limits<float>::quiet_NaN();
      v[static_cast<std::size_t>(b * 16 + i)] = x;
    }
  }
  return v;
}

// Quantizes host x on the GPU (public call with a host and with a device global scale; into strided, poisoned
// outputs) and compares with the CPU; then the dequantization both ways.
void compare(const Tensor& x, float gs, Nvfp4ScaleLayout layout, const std::string& what) {
  const std::int64_t T = x.size(0), H = x.size(1);
  const Nvfp4Tensor want = quantize_nvfp4(x, host_scalar(gs), layout);
  const Tensor x_dev = to_device(x), gs_host = host_scalar(gs), gs_dev = to_device(gs_host);
  for (const Tensor* g : {&gs_host, &gs_dev}) {
    const Nvfp4Tensor got = quantize_nvfp4(x_dev, *g, layout);
    EXPECT_TRUE(same_bits(want.data, to_host(got.data))) << what << " q";
    EXPECT_TRUE(same_bits(want.scales, to_host(got.scales))) << what << " scales";
  }
  // Strided q rows (8 bytes more: the 8-byte stores) and scale rows.
  const std::int64_t qw = H / 2 + 8, sr = want.scales.size(0), sw = want.scales.size(1) + 4;
  Tensor q_store = Tensor::empty(DType::uint8, {std::max<std::int64_t>(T, 1), qw}, gputest::gpu());
  Tensor s_store = Tensor::empty(DType::fp8_e4m3, {std::max<std::int64_t>(sr, 1), sw}, gputest::gpu());
  gputest::poison(q_store);
  gputest::poison(s_store);
  const TensorView q(q_store.data(), DType::uint8, {T, H / 2}, {qw, 1}, gputest::gpu());
  const TensorView s(s_store.data(), DType::fp8_e4m3, {sr, want.scales.size(1)}, {sw, 1}, gputest::gpu());
  quantize_nvfp4_into(x_dev, gs_dev, q, s, layout);
  EXPECT_TRUE(same_bits(want.data, to_host(q))) << what << " strided q";
  EXPECT_TRUE(same_bits(want.scales, to_host(s))) << what << " strided scales";
  for (DType out : {DType::bf16, DType::fp32}) {
    const Tensor dq_want = dequantize_nvfp4(want.data, want.scales, host_scalar(gs), layout, out);
    const Tensor dq_got = dequantize_nvfp4(to_device(want.data), to_device(want.scales), gs_dev, layout, out);
    EXPECT_TRUE(same_bits(dq_want, to_host(dq_got))) << what << " dequantize to " << dtype_name(out);
  }
}

TEST(GpuNvfp4, QuantizeAndDequantizeMatchCpuBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  std::vector<std::int64_t> hs = gputest::hidden_sizes();
  hs.push_back(64);
  for (std::int64_t T : gputest::token_counts())
    for (std::int64_t H : hs)
      for (DType dtype : {DType::bf16, DType::fp32}) {
        if (T >= 4096 && dtype == DType::fp32 && H != 2880) continue;
        const std::vector<float> v = random_values(rng, T, H);
        const Tensor x = as_dtype(v, dtype, T, H);
        float amax = 0.0f;
        for (float f : v)
          if (std::isfinite(f)) amax = std::max(amax, std::fabs(f));
        for (Nvfp4ScaleLayout layout : {Nvfp4ScaleLayout::linear, Nvfp4ScaleLayout::swizzled}) {
          const float gs = amax > 0.0f ? 448.0f * 6.0f / amax : 1.0f;
          compare(x, gs, layout,
                  "T=" + std::to_string(T) + " H=" + std::to_string(H) + " " + std::string(dtype_name(dtype)) + " " +
                      nvfp4_scale_layout_name(layout));
          if (HasFailure()) return;
        }
      }
}

// Dense sweep: with gs = 1, a block holding 6 has scale 1 and its values become e2m1(x) directly, so the sweep's
// floats (|x| <= 6, every boundary of e2m1 and its neighbours, NaN) meet the conversion unchanged. Then zero blocks,
// blocks whose scale rounds down (6.36 saturates), and blocks whose scale is every subnormal e4m3 value and the
// boundaries between them (amax / 6 sweeping 0 .. 2^-6).
TEST(GpuNvfp4, DenseSweepTiesZeroBlocksSaturationAndSubnormalScales) {
  std::vector<float> v;
  auto block = [&](float first, auto&& rest) {
    v.push_back(first);
    for (int i = 1; i < 16; ++i) v.push_back(rest(i));
  };
  std::vector<float> sweep;
  for (std::uint32_t b : test::e2m1_sweep_bits()) {
    const float f = bits_float(b);
    if (std::isnan(f) || std::fabs(f) <= 6.0f) sweep.push_back(f);
  }
  for (std::size_t i = 0; i < sweep.size(); i += 15)
    block(6.0f, [&](int j) { return i + j - 1 < sweep.size() ? sweep[i + j - 1] : 1.0f; });
  for (int z = 0; z < 64; ++z) block(z % 2 ? -0.0f : 0.0f, [&](int j) { return j == z % 16 ? -0.0f : 0.0f; });
  for (float top : {6.36f, 6.7f, 7.0f, 6.0001f, 1e30f})
    block(top, [&](int j) { return j % 2 ? -top : top * static_cast<float>(j) / 16.0f; });
  for (int k = 1; k <= 2048; ++k) {
    const float amax = std::ldexp(6.0f * static_cast<float>(k) / 256.0f, -9);  // amax / 6 = (k / 256) * 2^-9
    block(amax, [&](int j) { return amax * (static_cast<float>(j) / 15.0f) * (j % 3 ? 1.0f : -1.0f); });
  }
  const std::int64_t H = 64, T = static_cast<std::int64_t>((v.size() + H - 1) / H);
  v.resize(static_cast<std::size_t>(T * H), 0.5f);
  const Tensor x = as_dtype(v, DType::fp32, T, H);
  for (Nvfp4ScaleLayout layout : {Nvfp4ScaleLayout::linear, Nvfp4ScaleLayout::swizzled})
    compare(x, 1.0f, layout, std::string("sweep ") + nvfp4_scale_layout_name(layout));
  // And against the float64 model, with its error bound, on the GPU's results.
  const Nvfp4Tensor got = quantize_nvfp4(to_device(x), host_scalar(1.0f), Nvfp4ScaleLayout::linear);
  const test::RefNvfp4 ref = test::ref_quantize_nvfp4(v, T, H, 1.0f);
  const Tensor q = to_host(got.data), s = to_host(got.scales);
  EXPECT_EQ(std::memcmp(q.data(), ref.q.data(), ref.q.size()), 0);
  EXPECT_EQ(std::memcmp(s.data(), ref.scales.data(), ref.scales.size()), 0);
  const Tensor deq =
      to_host(dequantize_nvfp4(got.data, got.scales, host_scalar(1.0f), Nvfp4ScaleLayout::linear, DType::fp32));
  std::size_t bad = 0;
  for (std::int64_t i = 0; i < T * H; ++i) {
    const double xi = v[static_cast<std::size_t>(i)];
    if (!std::isfinite(xi)) continue;
    const std::size_t b = static_cast<std::size_t>(i / 16);
    const double st = ref.step[b], bound = std::fmax(st, ref.amax[b] - 6.0 * st) * (1.0 + 1e-6) + 1e-44;
    bad += std::fabs(xi - deq.ptr<float>()[i]) > bound;
  }
  EXPECT_EQ(bad, 0u) << "elements past the round-trip bound";
}

TEST(GpuNvfp4, DequantizeArbitraryCodesAndScales) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t H : {std::int64_t{64}, std::int64_t{2880}, std::int64_t{7168}})
    for (Nvfp4ScaleLayout layout : {Nvfp4ScaleLayout::linear, Nvfp4ScaleLayout::swizzled}) {
      const std::int64_t T = 131;
      Tensor q = Tensor::empty(DType::uint8, {T, H / 2});
      gputest::fill_random(rng(), q);
      const std::int64_t sr = layout == Nvfp4ScaleLayout::linear ? T : nvfp4_row_tiles(T);
      const std::int64_t sc = layout == Nvfp4ScaleLayout::linear ? H / 16 : nvfp4_col_tiles(H) * kNvfp4TileBytes;
      Tensor s = Tensor::empty(DType::fp8_e4m3, {sr, sc});
      auto* sb = static_cast<std::uint8_t*>(s.data());
      std::uniform_int_distribution<int> code(0, 255);
      for (std::int64_t i = 0; i < s.numel(); ++i) {
        const int c = code(rng) & 0x7f;  // scales are positive; NaN codes (0x7f) replaced: x86 and CUDA NaNs differ
        sb[i] = static_cast<std::uint8_t>(c == 0x7f ? 0x38 : c);
      }
      for (DType out : {DType::bf16, DType::fp32}) {
        const Tensor want = dequantize_nvfp4(q, s, host_scalar(0.75f), layout, out);
        const Tensor got = dequantize_nvfp4(to_device(q), to_device(s), host_scalar(0.75f), layout, out);
        EXPECT_TRUE(same_bits(want, to_host(got))) << "H=" << H << " " << nvfp4_scale_layout_name(layout) << " "
                                                   << dtype_name(out);
      }
    }
}

// The low-latency slabs (q [E, rows, H / 2], swizzled scales per slab): only each slab's first masked_m[e] rows are
// written (the CPU's bits); the other rows keep their poison.
TEST(GpuNvfp4, MaskedSlabDequantizeWritesTheCountedRowsOnly) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t H : {std::int64_t{2048}, std::int64_t{7168}}) {
    const std::int64_t E = 6, rows = 130;
    const std::int32_t counts[E] = {0, 1, 7, 130, 400, -3};
    Tensor m = Tensor::empty(DType::int32, {E});
    const std::int64_t slab_scales = nvfp4_row_tiles(rows) * nvfp4_col_tiles(H) * kNvfp4TileBytes;
    Tensor q_all = Tensor::empty(DType::uint8, {E, rows, H / 2});
    Tensor s_all = Tensor::empty(DType::fp8_e4m3, {E, nvfp4_row_tiles(rows), nvfp4_col_tiles(H) * kNvfp4TileBytes});
    std::vector<Tensor> want;
    for (std::int64_t e = 0; e < E; ++e) {
      m.ptr<std::int32_t>()[e] = counts[e];
      const Tensor x = as_dtype(random_values(rng, rows, H), DType::bf16, rows, H);
      const Nvfp4Tensor qe = quantize_nvfp4(x, host_scalar(3.0f), Nvfp4ScaleLayout::swizzled);
      std::memcpy(static_cast<std::uint8_t*>(q_all.data()) + e * rows * H / 2, qe.data.data(), qe.data.nbytes());
      std::memcpy(static_cast<std::uint8_t*>(s_all.data()) + e * slab_scales, qe.scales.data(), qe.scales.nbytes());
      want.push_back(dequantize_nvfp4(qe.data, qe.scales, host_scalar(3.0f), Nvfp4ScaleLayout::swizzled));
    }
    const Tensor m_dev = to_device(m), q_dev = to_device(q_all), s_dev = to_device(s_all);
    Tensor out = to_device(Tensor::empty(DType::bf16, {E, rows, H}));
    gputest::poison(out);
    quant_detail::dequantize_nvfp4_masked_cuda(q_dev, s_dev, {3.0f, nullptr}, out, m_dev.ptr<std::int32_t>(),
                                               Stream{});
    gputest::sync_ok();
    const Tensor got = to_host(out);
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t n = std::max<std::int64_t>(0, std::min<std::int64_t>(counts[e], rows));
      for (std::int64_t r = 0; r < rows; ++r) {
        const auto* g = static_cast<const char*>(got.data()) + (e * rows + r) * H * 2;
        const auto* w = static_cast<const char*>(want[static_cast<std::size_t>(e)].data()) + r * H * 2;
        if (r < n)
          EXPECT_EQ(std::memcmp(g, w, static_cast<std::size_t>(H) * 2), 0) << "H=" << H << " slab " << e << " row " << r;
        else
          EXPECT_NE(std::memcmp(g, w, static_cast<std::size_t>(H) * 2), 0) << "slab " << e << " row " << r << " written";
      }
    }
  }
}

TEST(GpuNvfp4, MisalignedRowsAreRejectedOnCuda) {
  Tensor store = Tensor::zeros(DType::bf16, {4, 2048 + 4});
  const Tensor dev = to_device(store);
  const TensorView x(dev.data(), DType::bf16, {4, 2048}, {2048 + 4, 1}, gputest::gpu());  // 8-byte row step
  try {
    quantize_nvfp4(x, host_scalar(1.0f));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'x'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace epmoe
