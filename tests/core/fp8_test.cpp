// fp8 e4m3 conversions on the CPU against the independent double-precision reference
// (support/quant_reference), so builds without CUDA test them too. The bit-exact comparison with
// CUDA's own converter is fp8_cuda_parity_test.cu.
#include <gtest/gtest.h>

#include <epmoe/dtype.hpp>

#include <cmath>
#include <limits>

#include "support/quant_reference.hpp"

namespace epmoe {
namespace {

std::uint8_t enc(float f) { return float_to_fp8_e4m3(f).bits; }
float dec(std::uint8_t c) { return fp8_e4m3_to_float(fp8_e4m3_t{c}); }

TEST(Fp8E4m3, DecodesAll256Codes) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const double want = test::ref_fp8_decode(code);
    const float got = dec(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_TRUE((c & 0x7f) == 0x7f) << "only 0x7f and 0xff are NaN";
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
  }
  EXPECT_EQ(dec(0x7e), 448.0f);
  EXPECT_EQ(dec(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(dec(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(dec(0x38), 1.0f);
}

TEST(Fp8E4m3, HandCases) {
  EXPECT_EQ(enc(0.0f), 0x00);
  EXPECT_EQ(enc(-0.0f), 0x80);
  EXPECT_EQ(enc(1.0f), 0x38);
  EXPECT_EQ(enc(-1.5f), 0xbc);
  EXPECT_EQ(enc(240.0f), 0x77);
  EXPECT_EQ(enc(1.0625f), 0x38);  // tie between 1.0 (even) and 1.125
  EXPECT_EQ(enc(1.1875f), 0x3a);  // tie between 1.125 (odd) and 1.25
  EXPECT_EQ(enc(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(enc(15.5f), 0x58);  // tie between 15 (odd) and 16 (mantissa carry into the exponent)
  EXPECT_EQ(enc(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(enc(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(enc(std::ldexp(1.0f, -10)), 0x00);  // tie with zero: even
  EXPECT_EQ(enc(-std::ldexp(1.0f, -10)), 0x80);
  EXPECT_EQ(enc(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(enc(std::ldexp(3.0f, -10)), 0x02);  // tie between subnormals 1 (odd) and 2
  EXPECT_EQ(enc(std::ldexp(15.0f, -10)), 0x08);  // 7.5 steps: tie -> 8 = smallest normal
  EXPECT_EQ(enc(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(Fp8E4m3, SaturatesToMaxFinite) {
  EXPECT_EQ(enc(448.0f), 0x7e);
  EXPECT_EQ(enc(447.0f), 0x7e);
  EXPECT_EQ(enc(449.0f), 0x7e);
  EXPECT_EQ(enc(464.0f), 0x7e);
  EXPECT_EQ(enc(465.0f), 0x7e);
  EXPECT_EQ(enc(480.0f), 0x7e);
  EXPECT_EQ(enc(1e30f), 0x7e);
  EXPECT_EQ(enc(-1e30f), 0xfe);
  EXPECT_EQ(enc(std::numeric_limits<float>::max()), 0x7e);
  EXPECT_EQ(enc(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(enc(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(enc(416.0f), 0x7d);
  EXPECT_EQ(enc(432.0f), 0x7e);  // tie between 416 (odd) and 448
}

TEST(Fp8E4m3, NanEncodesAs0x7f) {
  for (std::uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0xffc00000u, 0xff800001u})
    EXPECT_EQ(enc(bits_float(nan)), 0x7f) << std::hex << nan;
}

TEST(Fp8E4m3, EveryFiniteCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(enc(dec(static_cast<std::uint8_t>(c))), c);
  }
}

TEST(Fp8E4m3, DenseSweepMatchesDoubleReference) {
  const auto sweep = test::fp8_sweep_bits();
  ASSERT_GT(sweep.size(), 3'000'000u);
  for (std::uint32_t u : sweep) {
    const float f = bits_float(u);
    ASSERT_EQ(enc(f), test::ref_fp8_encode(static_cast<double>(f))) << "float bits 0x" << std::hex << u;
  }
}

}  // namespace
}  // namespace epmoe
