// NVFP4 quantization (semantics §6, "NVFP4") on CPU tensors against the independent float64 model of
// support/nvfp4_reference: the e2m1 conversion over a dense sweep and by hand at every rounding boundary, block
// scales by hand (zero blocks, saturation at 448, subnormal e4m3 scales), hand-made rows with ties, zero blocks and
// saturating values, random tensors bit for bit in both scale layouts with the round-trip error bound, strided
// outputs, and argument errors.
#include <gtest/gtest.h>

#include <epmoe/nvfp4.hpp>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/nvfp4_reference.hpp"
#include "support/quant_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using test::RefNvfp4;

Tensor scalar(float v) {
  Tensor t = Tensor::empty(DType::fp32, Shape{});
  *t.ptr<float>() = v;
  return t;
}

// bf16 or fp32 [T, H] holding `vals` (rounded to the dtype), and the values it holds.
Tensor make_x(std::vector<float>& vals, DType dtype, std::int64_t T, std::int64_t H) {
  Tensor x = Tensor::empty(dtype, {T, H});
  for (std::size_t i = 0; i < vals.size(); ++i) {
    if (dtype == DType::bf16) {
      x.ptr<bf16_t>()[i] = float_to_bf16(vals[i]);
      vals[i] = static_cast<float>(test::ref_bf16_decode(x.ptr<bf16_t>()[i].bits));
    } else {
      x.ptr<float>()[i] = vals[i];
    }
  }
  return x;
}

void expect_matches(const Nvfp4Tensor& got, const RefNvfp4& ref, Nvfp4ScaleLayout layout, const std::string& what) {
  ASSERT_EQ(got.data.dtype(), DType::uint8) << what;
  ASSERT_EQ(got.data.size(0), ref.T) << what;
  ASSERT_EQ(got.data.size(1), ref.H / 2) << what;
  const auto* q = got.data.ptr<std::uint8_t>();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < ref.q.size(); ++i)
    if (q[i] != ref.q[i] && ++bad <= 5)
      ADD_FAILURE() << what << ": byte " << i << " (token " << i / (ref.H / 2) << "): got 0x" << std::hex << int(q[i])
                    << ", model 0x" << int(ref.q[i]);
  EXPECT_EQ(bad, 0u) << what;
  const std::vector<std::uint8_t> want =
      layout == Nvfp4ScaleLayout::linear ? ref.scales : test::ref_swizzle(ref.scales, ref.T, ref.H);
  ASSERT_EQ(got.scales.dtype(), DType::fp8_e4m3) << what;
  ASSERT_EQ(got.scales.nbytes(), want.size()) << what;
  EXPECT_EQ(std::memcmp(got.scales.data(), want.data(), want.size()), 0) << what << " scales";
}

TEST(Nvfp4E2m1, HandCasesAtEveryBoundary) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // (value, code): ties go to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
  // 3.5 -> 4.0, 5.0 -> 4.0), saturation at +-6, signed zeros, NaN -> +6.
  const std::pair<float, int> cases[] = {
      {0.0f, 0x0},  {-0.0f, 0x8}, {0.1f, 0x0},     {-0.1f, 0x8},  {0.25f, 0x0}, {0.2500001f, 0x1},
      {0.5f, 0x1},  {0.75f, 0x2}, {0.7499999f, 0x1}, {1.0f, 0x2},   {1.25f, 0x2}, {1.2500001f, 0x3},
      {1.5f, 0x3},  {1.75f, 0x4}, {2.0f, 0x4},     {2.5f, 0x4},   {2.5000002f, 0x5}, {3.0f, 0x5},
      {3.5f, 0x6},  {4.0f, 0x6},  {5.0f, 0x6},     {5.0000005f, 0x7}, {6.0f, 0x7}, {6.5f, 0x7},
      {1e30f, 0x7}, {inf, 0x7},   {-inf, 0xf},     {-6.0f, 0xf},  {-3.5f, 0xe}, {-0.3f, 0x9},
      {nan, 0x7},   {-nan, 0x7}};
  for (const auto& [v, code] : cases) {
    EXPECT_EQ(float_to_e2m1(v), code) << v;
    EXPECT_EQ(test::ref_e2m1_encode(v), code) << v;
  }
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1_to_float(static_cast<std::uint8_t>(c)), test::ref_e2m1_decode(c)) << c;
}

TEST(Nvfp4E2m1, DenseSweepMatchesTheModel) {
  const auto sweep = test::e2m1_sweep_bits();
  ASSERT_GT(sweep.size(), 100000u);
  std::size_t bad = 0;
  for (std::uint32_t u : sweep) {
    const float f = bits_float(u);
    if (float_to_e2m1(f) != test::ref_e2m1_encode(f) && ++bad <= 10)
      ADD_FAILURE() << "float bits 0x" << std::hex << u << ": epmoe 0x" << int(float_to_e2m1(f)) << ", model 0x"
                    << int(test::ref_e2m1_encode(f));
  }
  EXPECT_EQ(bad, 0u);
}

TEST(Nvfp4BlockScale, HandCases) {
  // gs = 1: amax 6 -> scale 1.0 (0x38), multiplier 1.
  Nvfp4BlockScale s = nvfp4_block_scale(6.0f, 1.0f);
  EXPECT_EQ(s.code.bits, 0x38);
  EXPECT_EQ(s.multiplier, 1.0f);
  // A zero block: scale 0 and multiplier 0 (every code then +-0).
  s = nvfp4_block_scale(0.0f, 2688.0f);
  EXPECT_EQ(s.code.bits, 0x00);
  EXPECT_EQ(s.multiplier, 0.0f);
  // Saturation: (amax / 6) * gs above 448 stores 448 (0x7e); infinity too.
  EXPECT_EQ(nvfp4_block_scale(6.0f, 1000.0f).code.bits, 0x7e);
  EXPECT_EQ(nvfp4_block_scale(std::numeric_limits<float>::infinity(), 1.0f).code.bits, 0x7e);
  // Subnormal e4m3 scales (steps of 2^-9): (amax / 6) = 2.6 * 2^-9 -> 3 * 2^-9 (code 3), multiplier 512 / 3.
  s = nvfp4_block_scale(std::ldexp(6.0f * 2.6f, -9), 1.0f);
  EXPECT_EQ(s.code.bits, 0x03);
  EXPECT_EQ(s.multiplier, 512.0f / 3.0f);
  // Below half the smallest subnormal (2^-10): scale 0.
  EXPECT_EQ(nvfp4_block_scale(std::ldexp(6.0f * 0.49f, -9), 1.0f).code.bits, 0x00);
  // The producers' global scale 448 * 6 / amax makes the tensor's largest block scale exactly 448.
  const float amax = 3.7f, gs = 448.0f * 6.0f / amax;
  EXPECT_EQ(nvfp4_block_scale(amax, gs).code.bits, 0x7e);
  // A multiplier that would overflow is capped, so zeros stay zero.
  s = nvfp4_block_scale(std::ldexp(6.0f, -136), std::ldexp(1.0f, 127));  // scale 2^-9, gs / 2^-9 = 2^136
  EXPECT_EQ(s.code.bits, 0x01);
  EXPECT_EQ(s.multiplier, FLT_MAX);
  EXPECT_EQ(float_to_e2m1(0.0f * s.multiplier), 0x0);
}

// Rows built by hand with gs = 1 and codes known in advance; checked against the literal codes and the model.
TEST(Nvfp4Quantize, HandMadeRows) {
  const std::int64_t H = 64;  // 4 blocks
  std::vector<float> v(static_cast<std::size_t>(2 * H), 0.0f);
  // Token 0, block 0: amax 6 -> scale 1, values at every tie: codes 0x7, 0x0 (0.25), 0x2 (0.75), 0x2 (1.25),
  // 0x4 (1.75), 0x4 (2.5), 0x6 (3.5), 0x6 (5.0), then their negatives.
  const float ties[8] = {6.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const int tie_codes[8] = {0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6};
  for (int i = 0; i < 8; ++i) {
    v[static_cast<std::size_t>(i)] = ties[i];
    v[static_cast<std::size_t>(8 + i)] = -ties[i];
  }
  // Block 1: all zero (one -0): scale 0, codes 0 (0x8 for -0).
  v[16 + 3] = -0.0f;
  // Block 2: amax 6.36 -> (amax / 6) = 1.06 rounds to scale 1.0 (0x38), so 6.36 saturates at 6 (0x7).
  v[32] = 6.36f;
  v[33] = -6.36f;
  v[34] = 1.0f;
  // Block 3: a subnormal scale: amax 6 * 2.6 * 2^-9 -> scale 3 * 2^-9, multiplier 512 / 3; 2^-9 * 1.5 -> 0.5 (0x1).
  v[48] = std::ldexp(6.0f * 2.6f, -9);
  v[49] = std::ldexp(1.5f, -9);
  // Token 1: the same blocks scaled by 2^-3 with gs = 1: scales 2^-3 smaller, same codes where no subnormal.
  for (std::int64_t h = 0; h < 48; ++h) v[static_cast<std::size_t>(H + h)] = v[static_cast<std::size_t>(h)] * 0.125f;
  const Tensor x = make_x(v, DType::fp32, 2, H);
  const Tensor gs = scalar(1.0f);
  const Nvfp4Tensor got = quantize_nvfp4(x, gs, Nvfp4ScaleLayout::linear);
  const auto* q = got.data.ptr<std::uint8_t>();
  const auto* sc = static_cast<const std::uint8_t*>(got.scales.data());
  for (int i = 0; i < 8; ++i) {
    const int code = (q[i / 2] >> (4 * (i % 2))) & 0xf;
    const int neg = (q[(8 + i) / 2] >> (4 * ((8 + i) % 2))) & 0xf;
    EXPECT_EQ(code, tie_codes[i]) << ties[i];
    EXPECT_EQ(neg, tie_codes[i] | 0x8) << -ties[i];
  }
  EXPECT_EQ(sc[0], 0x38);
  EXPECT_EQ(sc[1], 0x00);
  for (int b = 8; b < 16; ++b) EXPECT_EQ(q[b], b == 9 ? 0x80 : 0x00) << b;  // block 1: -0 at channel 19
  EXPECT_EQ(sc[2], 0x38);
  EXPECT_EQ(q[16], 0xf7);        // 6.36 -> 0x7, -6.36 -> 0xf
  EXPECT_EQ(q[17] & 0xf, 0x2);   // 1.0
  EXPECT_EQ(sc[3], 0x03);
  EXPECT_EQ(q[24], 0x17);        // 2.6 * 6 * 2^-9 * 512 / 3 = 5.2 -> 6 (0x7); 1.5 * 2^-9 * 512 / 3 = 0.5 (0x1)
  EXPECT_EQ(sc[4 + 0], 0x20);    // token 1, block 0: 2^-3
  // Everything against the model too, in both layouts.
  expect_matches(got, test::ref_quantize_nvfp4(v, 2, H, 1.0f), Nvfp4ScaleLayout::linear, "hand rows");
  expect_matches(quantize_nvfp4(x, gs, Nvfp4ScaleLayout::swizzled), test::ref_quantize_nvfp4(v, 2, H, 1.0f),
                 Nvfp4ScaleLayout::swizzled, "hand rows swizzled");
}

// Blocks whose magnitudes span 2^-30 .. 2^30, some all zero, some with inf or NaN, a few huge.
std::vector<float> random_values(std::mt19937_64& rng, std::int64_t T, std::int64_t H, bool specials) {
  std::vector<float> v(static_cast<std::size_t>(T * H));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> k(-30, 30), pct(0, 99);
  for (std::int64_t b = 0; b < T * H / 16; ++b) {
    const int p = pct(rng);
    const float mag = std::ldexp(1.0f, k(rng));
    for (int i = 0; i < 16; ++i) {
      float x = p < 4 ? 0.0f : u(rng) * mag;
      if (specials && p == 5 && i == 3) x = std::numeric_limits<float>::infinity();
      if (specials && p == 6 && i == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[static_cast<std::size_t>(b * 16 + i)] = x;
    }
  }
  return v;
}

float tensor_amax(const std::vector<float>& v) {
  float a = 0.0f;
  for (float x : v)
    if (std::isfinite(x)) a = std::fmax(a, std::fabs(x));
  return a;
}

// |x - x'| <= max(s, amax - 6 s) per element (s = float(sf) / gs): half of e2m1's widest step below 6 is 1, and a
// value past 6 s saturates; plus float32 rounding of the multiplier and the product.
void expect_error_bound(const std::vector<float>& v, const RefNvfp4& ref, const Tensor& deq, const std::string& what) {
  const float* d = deq.ptr<float>();
  std::size_t bad = 0;
  for (std::int64_t i = 0; i < ref.T * ref.H; ++i) {
    const double x = v[static_cast<std::size_t>(i)];
    if (!std::isfinite(x)) continue;
    const std::size_t b = static_cast<std::size_t>(i / 16);
    const double s = ref.step[b], bound = std::fmax(s, ref.amax[b] - 6.0 * s) * (1.0 + 1e-6) + 1e-44;
    if (std::fabs(x - d[i]) > bound && ++bad <= 5)
      ADD_FAILURE() << what << ": element " << i << " x = " << x << " dequantized " << d[i] << " bound " << bound;
    if (static_cast<double>(d[i]) != ref.dequantized[static_cast<std::size_t>(i)] && ++bad <= 5)
      ADD_FAILURE() << what << ": element " << i << " dequantized " << d[i] << ", model "
                    << ref.dequantized[static_cast<std::size_t>(i)];
  }
  EXPECT_EQ(bad, 0u) << what;
}

TEST(Nvfp4Quantize, RandomTensorsMatchTheModelAndTheErrorBound) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t T : {1, 7, 130, 257})
    for (std::int64_t H : {64, 2048, 2880, 7168})
      for (DType dtype : {DType::bf16, DType::fp32}) {
        if (T > 130 && H > 2048 && dtype == DType::fp32) continue;
        std::vector<float> v = random_values(rng, T, H, dtype == DType::fp32);
        const Tensor x = make_x(v, dtype, T, H);
        // The producers' convention (448 * 6 / amax) and an arbitrary global scale.
        for (float gs : {448.0f * 6.0f / tensor_amax(v), 0.37f}) {
          const RefNvfp4 ref = test::ref_quantize_nvfp4(v, T, H, gs);
          const Tensor g = scalar(gs);
          const std::string what = "T=" + std::to_string(T) + " H=" + std::to_string(H) + " " +
                                   std::string(dtype_name(dtype)) + " gs=" + std::to_string(gs);
          for (Nvfp4ScaleLayout layout : {Nvfp4ScaleLayout::linear, Nvfp4ScaleLayout::swizzled}) {
            const Nvfp4Tensor got = quantize_nvfp4(x, g, layout);
            expect_matches(got, ref, layout, what + " " + nvfp4_scale_layout_name(layout));
            const Tensor deq = dequantize_nvfp4(got.data, got.scales, g, layout, DType::fp32);
            expect_error_bound(v, ref, deq, what + " " + nvfp4_scale_layout_name(layout));
            const Tensor deq16 = dequantize_nvfp4(got.data, got.scales, g, layout, DType::bf16);
            std::size_t bad = 0;
            for (std::int64_t i = 0; i < T * H; ++i)
              bad += test::ref_bf16_decode(deq16.ptr<bf16_t>()[i].bits) !=
                     test::ref_bf16_round(ref.dequantized[static_cast<std::size_t>(i)]);
            EXPECT_EQ(bad, 0u) << what << " bf16 dequantization";
          }
        }
      }
}

TEST(Nvfp4Quantize, IntoStridedOutputs) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 5, H = 192;
  std::vector<float> v = random_values(rng, T, H, false);
  const Tensor x = make_x(v, DType::bf16, T, H);
  const RefNvfp4 ref = test::ref_quantize_nvfp4(v, T, H, 2.0f);
  // Records as the low-latency dispatch stages them: the packed row, then its linear scales, 128 bytes apart.
  std::vector<std::uint8_t> store(static_cast<std::size_t>(T * 128), 0xab);
  const TensorView q(store.data(), DType::uint8, {T, H / 2}, {128, 1}, Device::cpu());
  const TensorView sc(store.data() + H / 2, DType::fp8_e4m3, {T, H / 16}, {128, 1}, Device::cpu());
  quantize_nvfp4_into(x, scalar(2.0f), q, sc, Nvfp4ScaleLayout::linear);
  for (std::int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(std::memcmp(store.data() + t * 128, ref.q.data() + t * H / 2, H / 2), 0) << t;
    EXPECT_EQ(std::memcmp(store.data() + t * 128 + H / 2, ref.scales.data() + t * H / 16, H / 16), 0) << t;
    EXPECT_EQ(store[static_cast<std::size_t>(t * 128 + H / 2 + H / 16)], 0xab) << "past the record " << t;
  }
  // Swizzled into a poisoned matrix: padding tokens of the last row of tiles become 0.
  Tensor qs = Tensor::empty(DType::uint8, {T, H / 2});
  Tensor ss = Tensor::empty(DType::fp8_e4m3, {1, nvfp4_col_tiles(H) * kNvfp4TileBytes});
  std::memset(ss.data(), 0xcd, ss.nbytes());
  quantize_nvfp4_into(x, scalar(2.0f), qs, ss, Nvfp4ScaleLayout::swizzled);
  const std::vector<std::uint8_t> want = test::ref_swizzle(ref.scales, T, H);
  EXPECT_EQ(std::memcmp(ss.data(), want.data(), want.size()), 0);
}

TEST(Nvfp4Quantize, ArgumentErrorsNameTheArgument) {
  std::mt19937_64 rng(test::fresh_seed());
  const Tensor x = test::random_bf16(rng, 4, 64);
  const Tensor gs = scalar(1.0f);
  auto expect_named = [](const char* name, auto&& call) {
    try {
      call();
      ADD_FAILURE() << "no error for " << name;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::string("'") + name + "'"), std::string::npos) << e.what();
    }
  };
  const Tensor x48 = Tensor::zeros(DType::bf16, {2, 48}), x24 = Tensor::zeros(DType::bf16, {2, 24});
  expect_named("x", [&] { quantize_nvfp4(x24, gs, Nvfp4ScaleLayout::linear); });  // H % 16
  expect_named("x", [&] { quantize_nvfp4(x48, gs, Nvfp4ScaleLayout::swizzled); });  // H % 64
  (void)quantize_nvfp4(x48, gs, Nvfp4ScaleLayout::linear);  // fine linear
  expect_named("x", [&] { quantize_nvfp4(Tensor::zeros(DType::int32, {2, 64}), gs); });
  expect_named("global_scale", [&] { quantize_nvfp4(x, TensorView{}); });
  expect_named("global_scale", [&] { quantize_nvfp4(x, Tensor::zeros(DType::fp16, {1})); });
  expect_named("global_scale", [&] { quantize_nvfp4(x, Tensor::zeros(DType::fp32, {2})); });
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    expect_named("global_scale", [&] { quantize_nvfp4(x, scalar(bad)); });
  Tensor one = Tensor::empty(DType::fp32, {1});
  *one.ptr<float>() = 3.0f;
  (void)quantize_nvfp4(x, one);  // shape [1] is a scalar too
  const Nvfp4Tensor q = quantize_nvfp4(x, gs);
  expect_named("q", [&] { quantize_nvfp4_into(x, gs, Tensor::zeros(DType::uint8, {4, 31}), q.scales); });
  expect_named("scales", [&] { quantize_nvfp4_into(x, gs, q.data, Tensor::zeros(DType::fp8_e4m3, {4, 4})); });
  expect_named("out_dtype", [&] { dequantize_nvfp4(q.data, q.scales, gs, Nvfp4ScaleLayout::swizzled, DType::fp16); });
  expect_named("scales", [&] { dequantize_nvfp4(q.data, q.scales, gs, Nvfp4ScaleLayout::linear); });
  expect_named("q", [&] { dequantize_nvfp4(Tensor::zeros(DType::int8, {4, 32}), q.scales, gs); });
}

}  // namespace
}  // namespace epmoe
