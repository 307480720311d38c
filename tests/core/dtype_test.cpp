// bf16 and fp16 conversions: hand cases (ties, NaN, infinities, subnormals) and sweeps against the
// independent double-precision references in support/quant_reference.
#include <gtest/gtest.h>

#include <epmoe/dtype.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

#include "support/quant_reference.hpp"

namespace epmoe {
namespace {

std::uint16_t bf16_bits_of(std::uint32_t float_pattern) { return float_to_bf16(bits_float(float_pattern)).bits; }
std::uint16_t fp16_bits_of(float f) { return float_to_fp16(f).bits; }

TEST(Dtype, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::fp16), 2u);
  EXPECT_EQ(dtype_size(DType::fp32), 4u);
  EXPECT_EQ(dtype_size(DType::fp8_e4m3), 1u);
  EXPECT_EQ(dtype_size(DType::int8), 1u);
  EXPECT_EQ(dtype_size(DType::int16), 2u);
  EXPECT_EQ(dtype_size(DType::int32), 4u);
  EXPECT_EQ(dtype_size(DType::int64), 8u);
  EXPECT_EQ(dtype_size(DType::boolean), 1u);
  EXPECT_EQ(dtype_name(DType::bf16), "bfloat16");
  EXPECT_EQ(dtype_name(DType::fp8_e4m3), "float8_e4m3fn");
  EXPECT_EQ(dtype_name(DType::boolean), "bool");
  EXPECT_EQ(dtype_of_v<bf16_t>, DType::bf16);
  EXPECT_EQ(dtype_of_v<std::int64_t>, DType::int64);
}

TEST(Bf16, ExactValuesRoundTrip) {
  EXPECT_EQ(bf16_bits_of(0x3f800000u), 0x3f80);  // 1.0
  EXPECT_EQ(bf16_bits_of(0xc0490000u), 0xc049);  // -3.140625
  EXPECT_EQ(bf16_to_float(bf16_t{0x3f80}), 1.0f);
  EXPECT_EQ(bf16_to_float(bf16_t{0x4049}), 3.140625f);
  EXPECT_EQ(bf16_to_float(bf16_t{0x0001}), std::ldexp(1.0f, -133));
}

TEST(Bf16, RoundsToNearestEvenOnTies) {
  EXPECT_EQ(bf16_bits_of(0x3f808000u), 0x3f80);  // 1 + 2^-8: tie, 0x3f80 is even
  EXPECT_EQ(bf16_bits_of(0x3f818000u), 0x3f82);  // tie between odd 0x3f81 and even 0x3f82
  EXPECT_EQ(bf16_bits_of(0x3f808001u), 0x3f81);  // just above the tie
  EXPECT_EQ(bf16_bits_of(0x3f817fffu), 0x3f81);  // just below the tie
  EXPECT_EQ(bf16_bits_of(0xbf818000u), 0xbf82);  // sign-symmetric
  EXPECT_EQ(bf16_bits_of(0x3fffffffu), 0x4000);  // mantissa carry into the exponent
}

TEST(Bf16, InfinitiesAndOverflow) {
  EXPECT_EQ(bf16_bits_of(0x7f800000u), 0x7f80);
  EXPECT_EQ(bf16_bits_of(0xff800000u), 0xff80);
  EXPECT_EQ(bf16_bits_of(0x7f7f7fffu), 0x7f7f);  // below the tie with infinity
  EXPECT_EQ(bf16_bits_of(0x7f7f8000u), 0x7f80);  // tie, 0x7f7f is odd: rounds up to inf
  EXPECT_EQ(bf16_bits_of(0x7f7fffffu), 0x7f80);  // FLT_MAX
  EXPECT_TRUE(std::isinf(bf16_to_float(bf16_t{0xff80})));
}

TEST(Bf16, NanStaysNanWithItsSign) {
  for (std::uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fffffffu, 0xffc00000u, 0xff800001u}) {
    const std::uint16_t b = bf16_bits_of(nan);
    EXPECT_EQ(b & 0x7f80, 0x7f80) << std::hex << nan;
    EXPECT_NE(b & 0x007f, 0) << "NaN " << std::hex << nan << " became infinity";
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000) << std::hex << nan;
    EXPECT_TRUE(std::isnan(bf16_to_float(bf16_t{b})));
  }
}

TEST(Bf16, SubnormalsAndZeros) {
  EXPECT_EQ(bf16_bits_of(0x00000000u), 0x0000);
  EXPECT_EQ(bf16_bits_of(0x80000000u), 0x8000);
  EXPECT_EQ(bf16_bits_of(0x00000001u), 0x0000);  // smallest float subnormal rounds to zero
  EXPECT_EQ(bf16_bits_of(0x00008000u), 0x0000);  // tie with 0x0001: even 0
  EXPECT_EQ(bf16_bits_of(0x00008001u), 0x0001);
  EXPECT_EQ(bf16_bits_of(0x00018000u), 0x0002);  // tie between odd 0x0001 and 0x0002
  EXPECT_EQ(bf16_bits_of(0x007fffffu), 0x0080);  // largest subnormal rounds up to the smallest normal
  EXPECT_EQ(bf16_bits_of(0x80008001u), 0x8001);
}

// Every high half with the low halves around the rounding boundary, against the reference.
TEST(Bf16, SweepMatchesDoubleReference) {
  for (std::uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const std::uint32_t u = (hi << 16) | lo;
      const float f = bits_float(u);
      if (std::isnan(f)) continue;  // covered by NanStaysNanWithItsSign
      const std::uint16_t got = float_to_bf16(f).bits;
      const double want = test::ref_bf16_round(f);
      const double got_v = test::ref_bf16_decode(got);
      ASSERT_EQ(got_v, want) << "float bits 0x" << std::hex << u;
      ASSERT_EQ(std::signbit(got_v), std::signbit(f)) << "float bits 0x" << std::hex << u;
    }
  }
}

TEST(Bf16, DecodesEveryPattern) {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float got = bf16_to_float(bf16_t{static_cast<std::uint16_t>(b)});
    const double want = test::ref_bf16_decode(static_cast<std::uint16_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), want) << "bf16 0x" << std::hex << b;
    ASSERT_EQ(std::signbit(got), std::signbit(want)) << "bf16 0x" << std::hex << b;
  }
}

TEST(Fp16, HandCases) {
  EXPECT_EQ(fp16_bits_of(1.0f), 0x3c00);
  EXPECT_EQ(fp16_bits_of(-2.0f), 0xc000);
  EXPECT_EQ(fp16_bits_of(65504.0f), 0x7bff);  // largest half
  EXPECT_EQ(fp16_bits_of(65519.996f), 0x7bff);  // below the tie with infinity
  EXPECT_EQ(fp16_bits_of(65520.0f), 0x7c00);  // tie, 0x7bff odd: infinity
  EXPECT_EQ(fp16_bits_of(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(fp16_bits_of(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(fp16_bits_of(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie, even
  EXPECT_EQ(fp16_bits_of(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, odd rounds up
  EXPECT_EQ(fp16_bits_of(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(fp16_bits_of(std::ldexp(1.0f, -25)), 0x0000);  // tie with 0: even
  EXPECT_EQ(fp16_bits_of(3 * std::ldexp(1.0f, -25)), 0x0002);  // tie, odd 1 rounds up
  EXPECT_EQ(fp16_bits_of(std::ldexp(1023.0f, -24)), 0x03ff);  // largest subnormal
  EXPECT_EQ(fp16_bits_of(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(fp16_bits_of(-0.0f), 0x8000);
  const std::uint16_t nan = fp16_bits_of(std::nanf(""));
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  EXPECT_TRUE(std::isnan(fp16_to_float(fp16_t{0x7c01})));
  EXPECT_TRUE(std::isinf(fp16_to_float(fp16_t{0xfc00})));
  EXPECT_EQ(fp16_to_float(fp16_t{0x0001}), std::ldexp(1.0f, -24));
}

// Every 20-bit prefix with the low 12 bits around the fp16 normal rounding boundary (bit 12),
// plus strided low bits that exercise subnormal rounding.
TEST(Fp16, SweepMatchesDoubleReference) {
  for (std::uint32_t hi = 0; hi < (1u << 20); ++hi) {
    for (std::uint32_t lo : {0x000u, 0x001u, 0x7ffu, 0x800u, 0x801u, 0xfffu}) {
      const std::uint32_t u = (hi << 12) | lo;
      const float f = bits_float(u);
      if (std::isnan(f)) continue;
      const std::uint16_t got = float_to_fp16(f).bits;
      const double got_v = test::ref_fp16_decode(got);
      ASSERT_EQ(got_v, test::ref_fp16_round(f)) << "float bits 0x" << std::hex << u;
      ASSERT_EQ(std::signbit(got_v), std::signbit(f)) << "float bits 0x" << std::hex << u;
    }
  }
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float got = fp16_to_float(fp16_t{static_cast<std::uint16_t>(b)});
    const double want = test::ref_fp16_decode(static_cast<std::uint16_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got));
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), want) << "half 0x" << std::hex << b;
  }
}

}  // namespace
}  // namespace epmoe
